"""Any chunked recurrence kernel under CP: run each local run from zero, pass the states, rerun from the true state.

A state-space or linear-attention layer's kernel (Mamba2's chunk scan, the gated delta
rule, ...) maps `(inputs of a stretch of tokens, initial state) -> (outputs, final state)`,
and its final state is affine in its initial one: `final = T(init) + final_0`. So:

1. each of this rank's runs is run from a zero state: its `final_0`, and `T` (a diagonal
   decay the caller computes from the inputs, or a matrix the caller gets by running the
   kernel on the identity);
2. the summaries of every run of the group cross in one all-gather and each run's true
   initial state is composed in global order (`states.initial_states`, float32, zero at
   a document start);
3. each run that continues a document is run again from its true state.

Exact by construction, whatever the kernel (transformers' torch reference, or
mamba-ssm / flash-linear-attention when installed); the price is a second pass over the
runs that continue a document. Gradients flow back through step 3, the composition and
the all-gather to every rank's summaries.

A kernel that takes no initial state (mamba-ssm's selective scan) cannot be rerun from
one: its caller gives a `Correction` instead, the run's final state from zero and its
exact outputs from the zero-state ones and the true initial state (the outputs are
affine in it too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.agreement import Field
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layouts import LayoutSpec
from cpcompose.mixers._checks import agree, layout_fields, local_layout
from cpcompose.mixers.states import Kind, continued_runs, initial_states, tie

__all__ = ["Correction", "RunKernel", "cp_chunked_recurrence"]

RunKernel = Callable[[slice, Tensor | None], tuple[Tensor, Tensor | None]]
"""`(local rows of one run, its initial state or None for zero) -> (its outputs, its final state)`; the final
state may be None (and the initial state is always None) when the caller gives a `Correction`."""


@dataclass(frozen=True)
class Correction:
    """In place of a rerun, for a kernel with no initial state: what the true initial state changes."""

    final: Callable[[slice], Tensor]
    """A run's final state from a zero state (asked only of the runs a later run continues)."""
    apply: Callable[[slice, Tensor, Tensor], Tensor]
    """`(rows, the run's outputs from a zero state, its true initial state) -> its exact outputs`."""


def cp_chunked_recurrence(
    kernel: RunKernel,
    transition: Callable[[slice], Tensor],
    *,
    mesh: DeviceMesh,
    layout: LayoutSpec,
    seq_local: int,
    kind: Kind,
    out_dim: int,
    what: str,
    device: torch.device,
    dtype: torch.dtype,
    grad: bool,
    signature: Sequence[Field] = (),
    caller_error: str | None = None,
    meter: CommMeter | None = None,
    correction: Correction | None = None,
) -> Tensor:
    """The recurrence's outputs over this rank's shard, exact over the global sequence.

    Args:
        kernel: runs one local run (see `RunKernel`); outputs have the run's tokens on `out_dim`.
        transition: a run's `T` for `kind` ("diagonal": `final = T * init + final_0`;
            "matrix": `final = T @ init + final_0` on the state's dim -2), with the batch
            dims of the state.
        mesh, layout: the CP mesh and the split; `seq_local`: this rank's tokens.
        out_dim: the outputs' token dim (they are concatenated along it in local order).
        what, device, dtype, grad: for the agreement (its name, where its tensor lives, the
            inputs' dtype, whether a backward will run: it communicates, so all ranks must).
        signature: the caller's own fields every rank must share (its shapes).
        caller_error: the caller's complaint about this call, raised on every rank.
        meter: counts the summaries' bytes.
        correction: for a kernel that takes no initial state: its final states and exact
            outputs come from here instead of the kernel and a rerun.

    Raises:
        ValueError: on every rank, before any state moves, if any rank's input is invalid
            or the ranks' calls differ.
    """
    cp = CPGroup.from_mesh(mesh)
    split, error = local_layout(layout, cp, seq_local)
    fields = [*layout_fields(split, dtype, grad), ("kind", ("diagonal", "matrix").index(kind)), *signature]
    agree(cp, caller_error or error, fields, what=what, device=device)
    assert split is not None
    seq_len = seq_local * cp.world
    every = [split.runs(r, seq_len) for r in range(cp.world)]
    runs = every[cp.rank]
    starts = {run.doc: run.pos for run in split.global_runs(seq_len)}
    rows = [slice(run.row, run.row + run.length) for run in runs]
    outputs, finals = zip(*(kernel(r, None) for r in rows))
    # Only the runs a later run continues send a summary; the others' are placeholders, which need a
    # gradient when a backward runs: a rank with no continued run must still join the summaries'
    # reduce-scatter in its backward.
    final = (lambda i: finals[i]) if correction is None else (lambda i: correction.final(rows[i]))
    needed = {i: (transition(rows[i]), final(i)) for i in continued_runs(every)[cp.rank]}
    template = next(iter(needed.values())) if needed else (transition(rows[0]), final(0))
    placeholders = [torch.zeros_like(t).requires_grad_(grad) for t in template]
    transitions, ends = (torch.stack([needed[i][k] if i in needed else placeholders[k] for i in range(len(rows))])
                         for k in (0, 1))
    inits = initial_states(ends, transitions, cp=cp, layout=split, seq_len=seq_len, kind=kind, meter=meter)
    rerun = (lambda r, _, init: kernel(r, init)[0]) if correction is None else correction.apply
    exact = [rerun(r, outputs[i], inits[i]) if run.pos != starts[run.doc] else outputs[i]
             for i, (r, run) in enumerate(zip(rows, runs))]
    return tie(torch.cat(exact, dim=out_dim), inits)
