"""`grouped_experts`: the float64 loop against a row-by-row reference, the grouped GEMM against the loop.

One process, no ranks. Every case has an expert with no rows between two with rows and one at the end, both
weight stackings (`transposed`), with and without per-expert biases. The tolerances are derived
(`tests/support/tolerance.py`): ULPS x eps x terms x max |reference|, `terms` the longest reduction behind a
compared value: hidden + intermediate for the two chained products, plus the rows a weight gradient sums.
In bfloat16 the GEMMs (grouped and looped alike) accumulate in float32 and round each stored result once, so
the reductions count at float32's eps and each bfloat16 result on the longest path (forward and backward)
adds one bfloat16 rounding: `ROUNDINGS`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompose.experts import ExpertWeights, grouped_experts, grouped_mm_refusal
from tests.support.tolerance import tolerance

HIDDEN, INTER = 16, 8
COUNTS = [3, 0, 5, 2, 0]  # an empty expert between two with rows, and one at the end
ROUNDINGS = 6  # stored bfloat16 results on the longest path: h, activation, out; and their three gradients


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _case(dtype: torch.dtype, *, transposed: bool, biased: bool, hidden: int = HIDDEN) -> tuple:
    g = torch.Generator().manual_seed(0)
    n, e = sum(COUNTS), len(COUNTS)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()

    gate_up = rand(e, hidden, 2 * INTER) if transposed else rand(e, 2 * INTER, hidden)
    down = rand(e, INTER, hidden) if transposed else rand(e, hidden, INTER)
    biases = (rand(e, 2 * INTER), rand(e, hidden)) if biased else (None, None)
    experts = ExpertWeights(gate_up, down, transposed=transposed, gate_up_bias=biases[0], down_bias=biases[1])
    return rand(n, hidden), torch.tensor(COUNTS), experts, torch.randn(n, hidden, generator=g).to(dtype)


def _leaves(rows: torch.Tensor, experts: ExpertWeights) -> dict[str, torch.Tensor]:
    named = {"rows": rows, "gate_up": experts.gate_up, "down": experts.down, "gate_up_bias": experts.gate_up_bias,
             "down_bias": experts.down_bias}
    return {k: v for k, v in named.items() if v is not None}


def _run(rows, counts, experts, cotangent, compute) -> dict[str, torch.Tensor]:
    """The output and every input's gradient for one cotangent."""
    leaves = _leaves(rows, experts)
    for t in leaves.values():
        t.grad = None
    out = compute(rows, counts, experts)
    out.backward(cotangent)
    return {"out": out.detach(), **{f"d{k}": v.grad for k, v in leaves.items()}}


def _row_by_row(rows, counts, experts) -> torch.Tensor:
    """Each row alone through its expert's two products (`linear` on one row)."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    out = []
    for x, e in zip(rows, expert_of_row.tolist()):
        w1, w2 = experts.gate_up[e], experts.down[e]
        if experts.transposed:
            w1, w2 = w1.T, w2.T
        b1 = None if experts.gate_up_bias is None else experts.gate_up_bias[e]
        b2 = None if experts.down_bias is None else experts.down_bias[e]
        out.append(F.linear(_swiglu(F.linear(x[None], w1, b1)), w2, b2))
    return torch.cat(out)


def _kernel(kernel: str):
    return lambda rows, counts, experts: grouped_experts(rows, counts, experts, activation=_swiglu, kernel=kernel)


TERMS = HIDDEN + INTER + sum(COUNTS)
LAYOUTS = [(False, False), (True, True), (False, True)]


@pytest.mark.parametrize("transposed,biased", LAYOUTS)
def test_the_float64_loop_is_each_row_alone(transposed: bool, biased: bool) -> None:
    case = _case(torch.float64, transposed=transposed, biased=biased)
    assert grouped_mm_refusal(case[0], case[2]) is not None  # float64: auto takes the loop
    got, want = _run(*case, _kernel("auto")), _run(*case, lambda r, c, e: _row_by_row(r, c, e))
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tolerance(want[name], terms=TERMS), msg=name)
    for name in ("dgate_up", "ddown", "dgate_up_bias", "ddown_bias"):  # the empty experts: exactly zero
        if name in got:
            assert not got[name][[1, 4]].any(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transposed,biased", LAYOUTS)
def test_the_grouped_gemm_is_the_loop(dtype: torch.dtype, transposed: bool, biased: bool) -> None:
    case = _case(dtype, transposed=transposed, biased=biased)
    assert grouped_mm_refusal(case[0], case[2]) is None
    got, want = _run(*case, _kernel("grouped_mm")), _run(*case, _kernel("loop"))
    for name in want:
        allowed = tolerance(want[name], terms=TERMS, dtype=torch.float32)["atol"]
        allowed += tolerance(want[name], terms=ROUNDINGS if dtype == torch.bfloat16 else 0, dtype=dtype)["atol"]
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=allowed, msg=name)
    for name in ("dgate_up", "ddown", "dgate_up_bias", "ddown_bias"):
        if name in got:
            assert not got[name][[1, 4]].any(), name


def test_an_expanded_gradient_goes_through() -> None:
    """`out.sum().backward()` hands the last product a stride-0 gradient, which torch's CPU kernel refuses."""
    rows, counts, experts, _ = _case(torch.float32, transposed=False, biased=False)
    grouped_experts(rows, counts, experts, activation=_swiglu, kernel="grouped_mm").sum().backward()
    assert experts.gate_up.grad is not None and not experts.gate_up.grad[1].any()


def test_no_rows_at_all() -> None:
    for kernel in ("grouped_mm", "loop"):
        _, _, experts, _ = _case(torch.float32, transposed=False, biased=True)
        rows = torch.zeros(0, HIDDEN, requires_grad=True)
        out = grouped_experts(rows, torch.zeros(len(COUNTS), dtype=torch.int64), experts, activation=_swiglu,
                              kernel=kernel)
        out.sum().backward()
        assert out.shape == (0, HIDDEN) and not experts.gate_up.grad.any() and not experts.down_bias.grad.any()


def test_what_the_grouped_gemm_refuses_goes_to_the_loop() -> None:
    rows, counts, experts, _ = _case(torch.float32, transposed=False, biased=False, hidden=6)  # 24-byte rows
    assert "multiples of 16 bytes" in grouped_mm_refusal(rows, experts)
    auto = grouped_experts(rows, counts, experts, activation=_swiglu)
    torch.testing.assert_close(auto, grouped_experts(rows, counts, experts, activation=_swiglu, kernel="loop"),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        grouped_experts(rows, counts, experts, activation=_swiglu, kernel="grouped_mm")
    rows64, counts64, experts64, _ = _case(torch.float64, transposed=False, biased=False)
    with pytest.raises(ValueError, match="float32, bfloat16 and float16, not torch.float64"):
        grouped_experts(rows64, counts64, experts64, activation=_swiglu, kernel="grouped_mm")


@pytest.mark.parametrize("bad,match", [
    ("rows", "rows for 10 counted"), ("dtype", "cast one side first"), ("counts", r"counts are \(5,\) integers"),
])
def test_bad_input_is_named(bad: str, match: str) -> None:
    rows, counts, experts, _ = _case(torch.float32, transposed=False, biased=False)
    if bad == "rows":
        rows = rows[:-1]
    elif bad == "dtype":
        rows = rows.double()
    else:
        counts = counts[:-1]
    with pytest.raises(ValueError, match=match):
        grouped_experts(rows, counts, experts, activation=_swiglu)
