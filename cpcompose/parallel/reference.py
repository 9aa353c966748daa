"""What "as exact as one process" means for `verify`: the same dtype's own error against float64.

A bfloat16 model on one process is not exact either: it is off from the float64 result by
its dtype's rounding, carried through every layer. A CP run of it is exact when it is off
by no more than that. So `verify` runs the model once more on one process in float64 (its
parameters, buffers and floating inputs cast in place, restored bit for bit afterwards) and
judges each module output of the CP run by its error against that float64 run, allowing
`FACTOR` times the error the single-process run of the same dtype shows there. A module that
saw only its rank's shard is off by O(0.1-1) on the tokens it got wrong: far beyond.

No run can be finer than float32 arithmetic (kernels compute in float32 whatever the model's
dtype: transformers' SSM and delta-rule kernels leave ~1e-7 in a float64 model), so no
tolerance goes below `FLOOR`. A model whose parameters are DTensors (FSDP, TP) cannot be cast
in place; it is judged against one rounding of its output dtype per element instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["FACTOR", "FLOOR", "allowed_error", "castable", "in_float64", "relative_error"]

FACTOR = 8.0
"""How many times the single-process error of the same dtype a CP output may show against float64.

CP changes only the order of the roundings, so its error is of the same size as one process's
(measured: within 2x for bf16 hybrids); 8 leaves room for the few elements where one run's
roundings happen to cancel."""

FLOOR = 256 * torch.finfo(torch.float32).eps
"""No tolerance is finer than float32 arithmetic over a few hundred roundings (~3e-5, relative)."""


def relative_error(got: Tensor, want: Tensor) -> float:
    """`max |got - want| / max |want|` in float64 (NaN and inf positions must agree, else inf)."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].nan_to_num(), want[~finite]
                                                                       .nan_to_num()):
        return math.inf
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().item()
    return (got[finite] - want[finite]).abs().max().item() / max(scale, 1e-30)


def allowed_error(same_dtype: Tensor, float64: Tensor | None) -> float:
    """The largest relative error against float64 a CP output may show, given the single-process output.

    `float64` is the float64 run's output (None when there is none): the single-process error
    is then estimated as one rounding of the output's dtype.
    """
    if float64 is None:
        single = torch.finfo(same_dtype.dtype).eps if same_dtype.is_floating_point() else 0.0
    else:
        single = relative_error(same_dtype, float64)
    return max(FACTOR * single, FLOOR)


def castable(model: nn.Module) -> bool:
    """Whether the model can run in float64 by casting in place (no DTensor parameter: FSDP and TP own theirs)."""
    return not any(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def in_float64(model: nn.Module) -> Iterator[None]:
    """The model's floating parameters and buffers in float64 for the block; the original tensors put back after.

    Parameters keep their objects (their `.data` is swapped), buffers are swapped in their modules: whatever
    holds them (an optimizer, a tie) sees the same tensors, bit for bit, afterwards.
    """
    params: list[tuple[nn.Parameter, Tensor]] = []
    buffers: list[tuple[nn.Module, str, Tensor]] = []
    try:
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != torch.float64:
                    params.append((p, p.data))
                    p.data = p.data.to(torch.float64)
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != torch.float64:
                    buffers.append((module, name, b))
                    module._buffers[name] = b.to(torch.float64)
        yield
    finally:
        for p, data in reversed(params):
            p.data = data
        for module, name, b in reversed(buffers):
            module._buffers[name] = b
