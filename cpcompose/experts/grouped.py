"""Every local expert over its rows: one grouped GEMM per projection where torch has one for the operands,
a loop over the experts elsewhere (float64 always: no grouped GEMM takes it).

The rows arrive sorted by expert (`counts[e]` rows for expert `e`, in expert order), as a token dispatch leaves
them. The grouped GEMM (`torch.nn.functional.grouped_mm`, `torch._grouped_mm` before 2.13) computes
`rows[offs[e-1]:offs[e]] @ B[e]` for every expert in one call, `offs` the cumulative counts. What it takes,
measured on torch 2.13:

* CPU: float32, bfloat16 and float16 (float64 is refused: "Expected mat_a to be Float32, BFloat16 or Float16");
  every stride but the unit one a multiple of 16 bytes ("strides should be multiple of 16 bytes": a hidden or
  intermediate size that is a multiple of 4 in float32, of 8 in bfloat16); int32 offsets; no `bias` (refused:
  "Bias not supported yet"); an output dtype equal to the input's. Rows past `offs[-1]` come back
  uninitialised, so `rows` must hold exactly `counts.sum()` of them. Its backward refuses an expanded gradient
  (strides 0, as `out.sum().backward()` sends), so each product's gradient is made contiguous first. An expert
  with no rows gets a zero weight gradient. On this CPU it gives the loop's values bit for bit.
* CUDA: compute capability 8.0 or more (transformers' `_can_use_grouped_mm`, torch's docs; not measured here).

The loop runs `F.linear` (or `@` for `transposed` weights) per expert with rows and skips experts without
rows: their slices of the stacked weights get zero gradients all the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from cpcompose import _compat
from cpcompose.comm.rehearsal import rehearsing
from cpcompose.experts.weights import ExpertWeights

__all__ = ["ExpertKernel", "grouped_experts", "grouped_mm_refusal"]

ExpertKernel = Literal["auto", "grouped_mm", "loop"]
"""How `grouped_experts` computes: auto (the grouped GEMM where `grouped_mm_refusal` is None, else the loop),
grouped_mm (raises where it cannot run), or loop (any dtype and device)."""

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_CAPABILITY = (8, 0)
_ALIGN = 16  # bytes


def _misaligned(t: Tensor) -> bool:
    """Whether a matrix (or a stack of them) breaks the grouped GEMM's stride rule: one unit stride among the
    last two, every other stride a multiple of 16 bytes."""
    if 1 not in t.stride()[-2:]:
        return True
    return any(s != 1 and (s * t.element_size()) % _ALIGN for s in t.stride())


def _as_right_operand(w: Tensor, transposed: bool) -> Tensor:
    """A stacked weight as the grouped GEMM's `B` `(experts, in, out)`: a view, never a copy."""
    return w if transposed else w.transpose(-2, -1)


def grouped_mm_refusal(rows: Tensor, experts: ExpertWeights) -> str | None:
    """Why the grouped GEMM cannot run these operands here (None: it can).

    The activation's output is not known yet: it is made contiguous, so only its width's alignment counts.
    """
    if _compat.grouped_mm is None:
        return f"torch {torch.__version__} has no grouped GEMM"
    device, dtype = rows.device, rows.dtype
    if device.type == "cpu":
        if dtype not in _CPU_DTYPES:
            return f"torch's CPU grouped GEMM takes float32, bfloat16 and float16, not {dtype}"
    elif device.type == "cuda":
        if torch.cuda.get_device_capability(device) < _CUDA_CAPABILITY:
            return f"torch's CUDA grouped GEMM needs compute capability {_CUDA_CAPABILITY} or more"
        if dtype == torch.float64:
            return "torch's CUDA grouped GEMM takes no float64"
    else:
        return f"no grouped GEMM on {device.type}"
    operands = {"rows": rows, "gate_up": _as_right_operand(experts.gate_up, experts.transposed),
                "down": _as_right_operand(experts.down, experts.transposed)}
    bad = [name for name, t in operands.items() if _misaligned(t)]
    if (experts.intermediate * rows.element_size()) % _ALIGN:
        bad.append("the activation's output")
    if bad:
        return f"{', '.join(bad)} not in strides of multiples of {_ALIGN} bytes (hidden {experts.hidden}, " \
               f"intermediate {experts.intermediate}, {dtype})"
    return None


class _ContiguousGrad(torch.autograd.Function):
    """The identity whose backward hands on a contiguous gradient: the grouped GEMM's backward refuses an
    expanded one (torch 2.13 CPU: "Invalid strides/sizes, got [0, 0] for strides")."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:  # type: ignore[override]
        if 0 in grad.stride():  # `contiguous()` keeps an empty tensor's zero strides, which the kernel refuses too
            return grad.clone(memory_format=torch.contiguous_format)
        return grad.contiguous()


def _grouped_projection(x: Tensor, w: Tensor, bias: Tensor | None, transposed: bool, offs: Tensor,
                        expert_of_row: Tensor | None) -> Tensor:
    out = _ContiguousGrad.apply(_compat.grouped_mm(x.contiguous(), _as_right_operand(w, transposed), offs=offs))
    return out if bias is None else out + bias[expert_of_row]


def _grouped(rows: Tensor, counts: Tensor, experts: ExpertWeights, activation: Callable[[Tensor], Tensor]) -> Tensor:
    offs = counts.cumsum(0, dtype=torch.int32)
    expert_of_row = None
    if experts.gate_up_bias is not None or experts.down_bias is not None:
        expert_of_row = torch.repeat_interleave(torch.arange(experts.num_experts, device=rows.device),
                                                counts.to(torch.int64), output_size=rows.shape[0])
    h = _grouped_projection(rows, experts.gate_up, experts.gate_up_bias, experts.transposed, offs, expert_of_row)
    h = activation(h)
    return _grouped_projection(h, experts.down, experts.down_bias, experts.transposed, offs, expert_of_row)


def _project(x: Tensor, w: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    if not transposed:
        return F.linear(x, w, bias)
    return x @ w if bias is None else torch.addmm(bias, x, w)


def _loop(rows: Tensor, counts: list[int], experts: ExpertWeights, activation: Callable[[Tensor], Tensor]) -> Tensor:
    def bias(b: Tensor | None, e: int) -> Tensor | None:
        return None if b is None else b[e]

    starts = [0, *itertools.accumulate(counts)]
    # Experts without rows are skipped; with no rows at all, expert 0 runs on none, so the weights still get
    # (zero) gradients, as the grouped GEMM gives them.
    pieces = []
    for e in [e for e, n in enumerate(counts) if n] or [0]:
        x = rows[starts[e]:starts[e + 1]]
        h = activation(_project(x, experts.gate_up[e], bias(experts.gate_up_bias, e), experts.transposed))
        pieces.append(_project(h, experts.down[e], bias(experts.down_bias, e), experts.transposed))
    return torch.cat(pieces)


def grouped_experts(rows: Tensor, counts: Tensor, experts: ExpertWeights, *,
                    activation: Callable[[Tensor], Tensor], kernel: ExpertKernel = "auto") -> Tensor:
    """Each expert's two projections over its rows: `down(activation(gate_up(rows)))`, expert by expert.

    Args:
        rows: `(n, hidden)` sorted by expert: expert 0's `counts[0]` rows first, then expert 1's, ...;
            `n == counts.sum()` exactly.
        counts: `(experts,)` integers, the rows of each expert (0 allowed).
        experts: the stacked weights (and biases) of the same experts, in `rows`' dtype.
        activation: the first projection's rows `(n, out)` to `(n, intermediate)`, row by row (gate and up
            split as the model stores them, e.g. transformers' `_apply_gate`; or one activation for
            ungated experts).
        kernel: "auto" (the grouped GEMM where `grouped_mm_refusal` is None, else the loop), "grouped_mm",
            or "loop" (the tests' reference).

    Returns:
        `(n, hidden)` in `rows`' dtype, row for row.

    Raises:
        ValueError: shapes or dtypes that do not match, or `kernel="grouped_mm"` where it cannot run (the
            reason said).
    """
    if rows.dim() != 2 or rows.shape[1] != experts.hidden:
        raise ValueError(f"rows are (n, hidden={experts.hidden}), got {tuple(rows.shape)}")
    if counts.shape != (experts.num_experts,) or counts.dtype.is_floating_point:
        raise ValueError(f"counts are ({experts.num_experts},) integers, got {tuple(counts.shape)} {counts.dtype}")
    if rows.dtype != experts.gate_up.dtype or rows.dtype != experts.down.dtype:
        raise ValueError(f"rows are {rows.dtype}, the expert weights {experts.gate_up.dtype}/{experts.down.dtype}: "
                         "cast one side first (the grouped GEMM does not promote)")
    if counts.device.type == "cpu" and not rehearsing() and int(counts.sum()) != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows for {int(counts.sum())} counted (rows past the counted ones would "
                         "come back uninitialised from the grouped GEMM)")
    refusal = grouped_mm_refusal(rows, experts) if kernel != "loop" else None
    if kernel == "grouped_mm" and refusal is not None:
        raise ValueError(f"kernel='grouped_mm' cannot run here: {refusal}")
    if kernel == "loop" or refusal is not None:
        return _loop(rows, counts.tolist(), experts, activation)
    return _grouped(rows, counts.to(rows.device), experts, activation)
