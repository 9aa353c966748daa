"""The SSD correction's own autograd Function against the same formula left to autograd, in float64.

`cpcompose.mixers.mamba_ssm.ssd._CarriedIn` computes `out + decay * (C . h0)` with a hand-written
backward (one shard-sized buffer forward, the gradient read through the state once). The CP tests
check it end to end; here it meets every input pattern its callers can give it: grouped heads,
a strided `C` (a view of the conv's output), an output gradient that a later op hands back
strided, a narrower output dtype than the accumulation's, and inputs that need no gradient.
"""

from __future__ import annotations

import pytest
import torch

from cpcompose.mixers.mamba_ssm.ssd import _CarriedIn

BATCH, LENGTH, GROUPS, HEADS, DIM, STATE = 2, 37, 2, 6, 5, 4


def _inputs(out_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    out = torch.randn(BATCH, LENGTH, HEADS, DIM, generator=g, dtype=torch.float64).to(out_dtype)
    wide = torch.randn(BATCH, LENGTH, 3 * GROUPS * STATE, generator=g, dtype=torch.float64)
    c = wide[..., GROUPS * STATE:2 * GROUPS * STATE].reshape(BATCH, LENGTH, GROUPS, STATE)  # strided, as the conv's
    h0 = torch.randn(BATCH, GROUPS, HEADS // GROUPS, DIM, STATE, generator=g, dtype=torch.float64)
    log_decay = -torch.rand(BATCH, LENGTH, HEADS, generator=g, dtype=torch.float64)
    decay = log_decay.cumsum(1).exp()[..., None]
    return out, c, h0, decay


def _reference(out: torch.Tensor, c: torch.Tensor, h0: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    carried = torch.einsum("blgn,bgkpn->blgkp", c, h0).reshape(out.shape)
    return out + (carried * decay).to(out.dtype)


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strided_grad", [False, True])
@pytest.mark.parametrize("needs", ["all", "no_out", "state_only"])
def test_matches_autograd(out_dtype: torch.dtype, strided_grad: bool, needs: str) -> None:
    inputs = _inputs(out_dtype)
    wanted = {"all": (True, True, True, True), "no_out": (False, True, True, True),
              "state_only": (False, False, True, False)}[needs]
    grad = torch.randn(BATCH, DIM, HEADS, LENGTH, dtype=torch.float64).to(out_dtype).permute(0, 3, 2, 1)
    grad = grad if strided_grad else grad.contiguous()
    results = []
    for fn in (_CarriedIn.apply, _reference):
        leaves = [t.detach().clone().requires_grad_(w) for t, w in zip(inputs, wanted)]
        y = fn(*leaves)
        y.backward(grad)
        results.append((y.detach(), [t.grad for t in leaves]))
    (y, grads), (y_ref, grads_ref) = results
    # Each value is a sum of at most STATE * HEADS * DIM * LENGTH products reassociated: 8 eps of the
    # widest dtype taking part per term of that length, relative to the reference's magnitude.
    eps = torch.finfo(out_dtype).eps
    terms = STATE * HEADS * DIM * LENGTH
    assert y.dtype == out_dtype
    torch.testing.assert_close(y, y_ref, rtol=0, atol=8 * eps * float(y_ref.abs().max()))
    for name, got, ref, w in zip(("out", "C", "h0", "decay"), grads, grads_ref, wanted):
        assert (got is None) == (not w), name
        if w:
            bound = 8 * torch.finfo(torch.float64).eps * terms * float(ref.abs().max())
            if name == "out":
                bound = 0.0  # passed through untouched
            torch.testing.assert_close(got, ref, rtol=0, atol=bound, msg=lambda m, n=name: f"{n}: {m}")
