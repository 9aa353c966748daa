"""Derived tolerances: how far two computations of the same values may differ, from the dtype and the sums.

Two runs that differ only in the order of their roundings (CP against one process, a
sharded step against a whole one, another CPU's kernels: Intel MKL, AMD, ARM,
`ATEN_CPU_CAPABILITY=avx2`) differ by rounding, and a sum of n terms is off by at most
about n roundings of its terms' size (the classic bound (n - 1) * eps * sum|x|). So a
test names the longest reduction its compared values come from (`terms`), and the allowed
difference is

    ULPS * eps(dtype) * terms * max |reference|

relative to the reference's magnitude, scaled by the dtype's epsilon and the reduction
length, never a number tuned on one machine. A real defect (a dropped or doubled term, a
wrong mask, position or reduction) is off by O(1) of some term: above this bound by
orders of magnitude for any `terms` a tiny test model has.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["ULPS", "assert_close", "relative_bound", "relative_error", "tolerance"]

ULPS = 4
"""Roundings allowed per term (two runs, each rounding each term once or twice)."""


def relative_bound(*, terms: int, dtype: torch.dtype = torch.float64) -> float:
    """The largest `relative_error` two orders of the same sums may show: ULPS * eps(dtype) * terms."""
    return ULPS * torch.finfo(dtype).eps * max(terms, 1)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """`max |actual - expected| / max |expected|`, in float64 (0 for an all-zero `expected` that is matched)."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def tolerance(reference: Tensor, *, terms: int, dtype: torch.dtype | None = None,
              scale: float | None = None) -> dict[str, float]:
    """`torch.testing.assert_close` keywords for values of `reference`'s size summed from `terms` terms.

    `dtype`: the precision the values were computed in, when it is lower than the reference's
    own (a float64 model whose kernel rounds to float32 inside). `scale`: the size of the terms,
    when it can exceed the result's (a sum that cancels, as a router gate's gradient does: the
    caller passes the largest gradient of the model).
    """
    eps = torch.finfo(dtype or (reference.dtype if reference.is_floating_point() else torch.float64)).eps
    finite = reference.detach()[torch.isfinite(reference.detach())] if reference.is_floating_point() else reference
    size = finite.abs().max().item() if finite.numel() else 0.0
    size = max(float(size), scale or 0.0, torch.finfo(torch.float64).tiny)
    return {"rtol": 0.0, "atol": ULPS * eps * max(terms, 1) * size}


def assert_close(actual: Any, expected: Any, *, terms: int | None = None, dtype: torch.dtype | None = None,
                 scale: float | None = None, **kwargs: Any) -> None:
    """`torch.testing.assert_close` at the derived tolerance when `terms` is given (`tolerance`), else with the
    caller's own keywords (a float32 kernel's rtol/atol); other keywords (msg=...) pass through either way."""
    if terms is None:  # the caller's float32 rtol/atol: `scale` has no meaning there
        torch.testing.assert_close(actual, expected, **kwargs)
        return
    expected = torch.as_tensor(expected)
    torch.testing.assert_close(actual, expected, **tolerance(expected, terms=terms, dtype=dtype, scale=scale),
                               **kwargs)
