"""cpcompose.mixers on real gloo groups against single-process float64 references.

Every rank's output and input gradients are compared with its shard of the
reference (tests/support/mixer_cases.py); replicated parameters (conv weight and bias) after
summing the ranks' gradients, as a data-parallel all-reduce would.

Tolerance: everything is float64, and the CP results differ from the references only
in the order of sums and products (conv1d's reduction, state composition across
ranks), so the errors are a few ulps of O(1) values times the chain length (at most
1.6e-14 measured); the derived bound (`TOL`) leaves margin and still catches any dropped or doubled term.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.mixer_cases import (
    B, C, DK, DV, F64, LAYOUTS, S_LOCAL, STATE, H, compose_ref, conv_cases, conv_inputs, conv_ref, delta_inputs,
    delta_ref, doc_starts, halo_rows, low_precision, make_layout, recurrence_cases, refusals, scan_inputs, scan_ref,
    summaries,
)
from tests.support.tolerance import assert_close

# Derived (tests/support/tolerance.py), float64: batch x sequence (P <= 4) x state width.
TOL = dict(terms=B * 4 * S_LOCAL * max(C, STATE, DK * DV))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_causal_conv1d(pools, world: int) -> None:
    widths = [1, 2, 4, S_LOCAL + 3]  # the last is wider than any chunk: its halo spans several ranks
    results = pools.get(world).run(conv_cases, widths)
    row_bytes = B * C * F64
    for case in range(len(results[0])):
        spec, width = results[0][case]["spec"], results[0][case]["width"]
        layout, seq = make_layout(spec, world), world * S_LOCAL
        x, w, b, probe = (t.requires_grad_() for t in conv_inputs(world, width))
        y = conv_ref(x, w, b, doc_starts(layout, seq), "silu" if width % 2 else None)
        (y * probe).sum().backward()
        sent, received = halo_rows(layout, seq, width)
        for rank, got in enumerate(r[case] for r in results):
            assert_close(got["y"], layout.shard(y.detach(), 1, rank), **TOL)
            assert_close(got["x"], layout.shard(x.grad, 1, rank), **TOL)
            # Forward: the halo rows this rank owns and others need; backward: their gradients coming home.
            assert (got["fwd"], got["bwd"]) == (sent[rank] * row_bytes, received[rank] * row_bytes), (spec, width)
        assert_close(sum(r[case]["w"] for r in results), w.grad, **TOL)
        assert_close(sum(r[case]["b"] for r in results), b.grad, **TOL)
        if spec != "packed" and 1 < width <= S_LOCAL // 2:
            # width-1 rows per chunk with a predecessor on another rank: 2P-2 under zigzag (chunk P
            # follows chunk P-1 on the same rank), P-1 contiguous.
            chunks = 2 * world - 2 if spec == "zigzag" else world - 1
            assert sum(r[case]["fwd"] for r in results) == chunks * (width - 1) * row_bytes
    packed = make_layout("packed", world)
    assert min(b - a for a, b in zip(packed.doc_bounds, packed.doc_bounds[1:])) < 4
    assert max(len({r for r in range(world) for _, _, d in packed.pieces[r] if d == doc})
               for doc in range(len(packed.doc_bounds) - 1)) == world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_linear_recurrences(pools, world: int) -> None:
    cases = [(spec, S_LOCAL) for spec in LAYOUTS] + [("zigzag", 2 * S_LOCAL)]
    results = pools.get(world).run(recurrence_cases, cases)
    for case, (spec, seq_local) in enumerate(cases):
        layout, seq = make_layout(spec, world, seq_local), world * seq_local
        starts = doc_starts(layout, seq)
        # Summaries travel only for runs that a later run of their document continues (zigzag:
        # both chunks but the last one, contiguous: every chunk but the last; whole documents never).
        continued = [sum(any(o.doc == run.doc and o.pos > run.pos for q in range(world) for o in layout.runs(q, seq))
                         for run in layout.runs(r, seq)) for r in range(world)]
        most = max(continued)
        assert most == {"zigzag": 2, "contiguous": 1}.get(spec, most)

        a, u, probe = (t.requires_grad_() for t in scan_inputs(seq))
        (scan_ref(a, u, starts) * probe).sum().backward()
        h = scan_ref(a.detach(), u.detach(), starts)
        inputs, probe = delta_inputs(seq)
        inputs = [t.requires_grad_() for t in inputs]
        (delta_ref(*inputs, starts) * probe).sum().backward()
        o = delta_ref(*(t.detach() for t in inputs), starts)
        for rank, got in enumerate(r[case] for r in results):
            for name, value in zip(("h", "a", "u"), (h, a.grad, u.grad)):
                assert_close(got["scan"][name], layout.shard(value, 1, rank), **TOL, msg=name)
            assert_close(got["delta"]["o"], layout.shard(o, 1, rank), **TOL)
            for name, mine, ref in zip("qkvbg", got["delta"]["grads"], inputs):
                assert_close(mine, layout.shard(ref.grad, 1, rank), **TOL, msg=name)
            # One gather of `most` padded (transition, final) rows per rank, and its reduce-scatter's
            # (P-1)/P of P x most rows: O(P x state), whatever the sequence length.
            scan_row, delta_row = 2 * B * STATE * F64, B * H * (DK * DK + DK * DV) * F64
            for got_bytes, row in ((got["scan"]["bytes"], scan_row), (got["delta"]["bytes"], delta_row)):
                assert got_bytes == {"all_gather": (world - 1) * most * row, "reduce_scatter": (world - 1) * most * row}
            if seq_local != S_LOCAL:  # zigzag at twice the length: exactly the bytes of case 0 (zigzag)
                assert (got["scan"]["bytes"], got["delta"]["bytes"]) == \
                    (results[rank][0]["scan"]["bytes"], results[rank][0]["delta"]["bytes"])

        for kind in ("diagonal", "matrix"):
            leaves = [summaries(layout, seq, r, kind) for r in range(world)]
            finals = [f.requires_grad_() for f, _, _ in leaves]
            transitions = [t.requires_grad_() for _, t, _ in leaves]
            inits = compose_ref(layout, seq, finals, transitions, kind)
            sum((i * p).sum() for i, (_, _, p) in zip(inits, leaves)).backward()
            for rank, got in enumerate(r[case][kind] for r in results):
                assert_close(got["init"], inits[rank].detach(), **TOL)
                for name, leaf in (("final", finals[rank]), ("trans", transitions[rank])):
                    expected = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad  # a last run feeds nothing
                    assert_close(got[name], expected, **TOL, msg=name)


def test_bad_input_on_one_rank_raises_everywhere(pools) -> None:
    results = pools.get(2).run(refusals)
    for r in results:
        assert r["shape"] == (B, S_LOCAL, C)
        assert "rank 1: weight must be a depthwise kernel (4, width)" in r["messages"]["channels"]
        assert "rank 0: global length (local 23 x 2 ranks) 46 is not divisible by 4" in r["messages"]["seq_local"]
        assert "inputs differ between CP ranks (dtype)" in r["messages"]["dtype"]
        assert "built for 3 CP ranks" in r["messages"]["world"]
        assert "rank 1: final must be (runs, *state) with 2 runs" in r["messages"]["runs"]
    assert results[0]["messages"] == results[1]["messages"]


def test_low_precision_keeps_dtype(pools) -> None:
    for r in pools.get(2).run(low_precision):
        for name, ((y64, g64), (y16, g16)) in r.items():
            assert y16.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in g16), name
            # bf16 keeps 8 bits of mantissa: a few 1e-2 relative over these short sums and chains.
            assert_close(y16.double(), y64, rtol=5e-2, atol=5e-2, msg=name)
            for g, ref in zip(g16, g64):
                assert_close(g.double(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item(), msg=name)

