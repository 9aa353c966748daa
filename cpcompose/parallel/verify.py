"""The exactness probe: run a model once under CP and once whole, and name the first module that differs.

Attention is not the only layer that mixes tokens: convolutions, recurrences, a pooling
or a cumulative sum over the sequence do too, and a model under CP that runs one of them
on this rank's shard alone is silently wrong. No list of known layers can be complete,
so `verify` measures instead: on every rank it runs the same full-sequence inputs through
the model on one process (no CP region), and then, sharded by the layout, inside a
`context_parallel` region; every module's output is recorded both times, and the CP
output (this rank's shard) is compared with the same shard of the full output, in the
order the CP run finished the modules (a module finishes after the modules it calls, so
the first to differ is the innermost culprit). Every rank then raises the same error
naming it (one tiny all-gather of each rank's first difference).

It costs two forwards of the model at the probe's length, under `torch.no_grad()`, plus a
copy of every module's output: run it at a short length (a few tokens per rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.attention.call.options import CPOptions
from cpcompose.comm import CPGroup, all_gather, all_gather_objects
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.parallel.context import context_parallel
from cpcompose.parallel.reference import FACTOR, allowed_error, castable, in_float64, relative_error

__all__ = ["Difference", "relative_error", "verify"]


@dataclass(frozen=True)
class Difference:
    """The first module whose CP output differs from the full run's."""

    index: int  # in the order the CP run finished modules
    name: str
    cls: str
    error: float
    what: str  # which output, and why it could not be compared when that is the problem
    tolerance: float = 0.0


def _tensors(output: Any, prefix: str = "output") -> list[tuple[str, Tensor]]:
    """Every tensor in a module's output (tuples, lists, dicts and ModelOutputs), with a path to name it."""
    if isinstance(output, Tensor):
        return [(prefix, output)]
    if isinstance(output, Mapping):
        return [t for k, v in output.items() for t in _tensors(v, f"{prefix}[{k!r}]")]
    if isinstance(output, (tuple, list)):
        return [t for i, v in enumerate(output) for t in _tensors(v, f"{prefix}[{i}]")]
    return []


class _Recorder:
    """Every module call's inputs and outputs, in the order the modules finish (a module called twice appears twice)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self.calls: list[tuple[str, str, list[tuple[str, Tensor]], list[tuple[str, Tensor]]]] = []
        self._inputs: dict[int, list[list[tuple[str, Tensor]]]] = {}
        self.handles = [h for m in model.modules() for h in (
            m.register_forward_pre_hook(self._enter, with_kwargs=True), m.register_forward_hook(self._record))]

    @staticmethod
    def _kept(value: Any, prefix: str) -> list[tuple[str, Tensor]]:
        # a DTensor (what a tensor-parallel style hands its module) as this rank's part: both runs are on the same
        # tp rank, and only CP differs between them
        return [(path, (t.to_local() if isinstance(t, DTensor) else t).detach().clone())
                for path, t in _tensors(value, prefix) if t.is_floating_point()]

    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._inputs.setdefault(id(module), []).append(self._kept(args, "input") + self._kept(kwargs, "input"))

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        inputs = self._inputs[id(module)].pop()
        self.calls.append((self.names[id(module)], type(module).__name__, inputs, self._kept(output, "output")))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def by_name(self) -> dict[tuple[str, int], tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]]:
        """(module name, its k-th call) -> (inputs, outputs)."""
        seen: dict[str, int] = {}
        out = {}
        for name, _, inputs, outputs in self.calls:
            k = seen[name] = seen.get(name, -1) + 1
            out[(name, k)] = (inputs, outputs)
        return out


def _shard_like(full: Tensor, local: Tensor, layout: Layout, rank: int, seq_len: int) -> Tensor | None:
    """This rank's part of a full-sequence tensor, shaped as its CP counterpart, or None if no dim is the sequence.

    The sequence dim is the one `seq_len` long that the CP tensor holds 1/P of (with batch
    1, a flattened (batch x sequence) token dim counts too); a tensor with no such dim is
    compared whole when the shapes agree.
    """
    if layout.world == 1:
        return full
    for dim in range(full.ndim):
        if full.shape[dim] == seq_len and full.shape[dim] == local.shape[dim] * layout.world and all(
            full.shape[d] == local.shape[d] for d in range(full.ndim) if d != dim
        ):
            return layout.shard(full, dim, rank)
    return full if full.shape == local.shape else None


def _compare(got: list[tuple[str, Tensor]], want: list[tuple[str, Tensor]],
             float64: list[tuple[str, Tensor]] | None, layout: Layout, rank: int,
             seq_len: int) -> tuple[float, float, str] | None:
    """The first tensor (error, tolerance, what) that differs beyond what one process of its dtype shows, or None.

    The CP tensor's error is measured against the float64 run's (when there is one) and may be
    `reference.FACTOR` times the single-process error of the same dtype (`reference.allowed_error`).
    A tensor that is not a per-token one (a padded convolution's output, L + width - 1 long)
    is no evidence either way: the module that reads it, and returns tokens, is compared.
    """
    exact = float64 if float64 is not None and len(float64) == len(want) else [None] * len(want)
    for (path, mine), (_, full), high in zip(got, want, exact):
        part = _shard_like(full, mine, layout, rank, seq_len)
        if part is None:
            continue
        part64 = None
        if high is not None and high[1].shape == full.shape:
            part64 = _shard_like(high[1], mine, layout, rank, seq_len)
        error = relative_error(mine, part if part64 is None else part64)
        allowed = allowed_error(part, part64)
        if error > allowed:
            against = (" against a float64 run" if part64 is not None else
                       " against one process of the same dtype (no float64 run: its error taken as one rounding)")
            return error, allowed, path + against
    return None


def _first_difference(full: _Recorder, cp: _Recorder, float64: _Recorder | None, layout: Layout, rank: int,
                      seq_len: int) -> Difference | None:
    """The first module (in the CP run's finish order) whose inputs agree with the full run's and outputs do not.

    A module fed a differing input is not where the difference arose (its caller, which
    finishes later, or an earlier module is); one called only in one run (a CP-aware
    module calling cpcompose's primitive instead of a submodule) cannot be compared.
    """
    reference = full.by_name()
    high = float64.by_name() if float64 is not None else {}
    seen: dict[str, int] = {}
    for i, (name, cls, inputs, outputs) in enumerate(cp.calls):
        k = seen[name] = seen.get(name, -1) + 1
        if (name, k) not in reference:
            continue
        want_inputs, want_outputs = reference[(name, k)]
        high_inputs, high_outputs = high.get((name, k), (None, None))
        if _compare(inputs, want_inputs, high_inputs, layout, rank, seq_len) is not None:
            continue
        differs = _compare(outputs, want_outputs, high_outputs, layout, rank, seq_len)
        if differs is not None:
            return Difference(i, name, cls, differs[0], differs[2], differs[1])
    return None


def verify(
    model: nn.Module,
    mesh: DeviceMesh,
    inputs: Sequence[Tensor] | Mapping[str, Tensor],
    *,
    seq_dims: int | Sequence[int] | Mapping[str, int] = 1,
    options: CPOptions | None = None,
    forward: Callable[..., Any] | None = None,
    **overrides: Any,
) -> None:
    """Check that `model` under CP computes what it computes on one process, module by module.

    Args:
        model: the model, not yet wrapped in anything that communicates on its own (run it
            before FSDP or pipelining; `ContextParallel` styles are fine: the probe's CP run
            is its own `context_parallel` region).
        mesh: the 1-D CP mesh.
        inputs: the full-sequence inputs, the same on every rank: positional (a sequence) or
            keyword (a mapping) arguments of `forward`. Use batch 1 and a short length.
        seq_dims: each input's sequence dim (one int for all).
        options, **overrides: the CP options of the run to check (`strategy=`, `layout=`, ...).
        forward: what to call (default `model`).

    Raises:
        ValueError: on every rank, naming the first module (in the order the CP run finished
            them) whose output is further from a float64 run than the same dtype on one process
            is (`reference.allowed_error`), and the likely cause.
    """
    cp = CPGroup.from_mesh(mesh)
    opts = (options or CPOptions()).replace(**overrides)
    layout = resolve_layout(opts.layout, cp.world)
    call = forward or model
    names = list(inputs) if isinstance(inputs, Mapping) else list(range(len(inputs)))
    values = [inputs[n] for n in names] if isinstance(inputs, Mapping) else list(inputs)
    dims = ([seq_dims[n] for n in names] if isinstance(seq_dims, Mapping)
            else [seq_dims] * len(values) if isinstance(seq_dims, int) else list(seq_dims))

    def run(args: list[Tensor]) -> None:
        if isinstance(inputs, Mapping):
            call(**dict(zip(names, args)))
        else:
            call(*args)

    with torch.no_grad():
        full = _Recorder(model)
        try:
            run([v.clone() for v in values])
        finally:
            full.remove()
        float64 = _float64_run(model, run, values, full)
        buffers = [v.clone() for v in values]
        sharded = _Recorder(model)
        try:
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims, options=opts):
                run(buffers)
        finally:
            sharded.remove()
    try:  # whatever happens here, every rank must reach the all-gather below
        found = _first_difference(full, sharded, float64, layout, cp.rank, values[0].shape[dims[0]] if values else 0)
    except Exception as e:  # noqa: BLE001 - reported on every rank instead of stranding the others
        found = Difference(0, "(the comparison)", type(e).__name__, math.inf, str(e))
    device = values[0].device if values else torch.device("cpu")
    mine = torch.tensor([found.index if found is not None else 1 << 62], dtype=torch.int64, device=device)
    first = int(all_gather(mine, cp).min().item())
    if first == 1 << 62:
        return
    mine_to_report = found if found is not None and found.index == first else None
    reports: list[Difference | None] = all_gather_objects(mine_to_report, cp.group)
    report = next(r for r in reports if r is not None)
    raise ValueError(
        f"cpcompose.verify: module '{report.name}' ({report.cls}) computes something else under CP than on one "
        f"process ({report.what}: relative error {report.error:.3g}, tolerance {report.tolerance:.3g}: "
        f"{FACTOR:g}x what one process of the same dtype shows). "
        "It is the first module to differ, in the order the CP run finished them: most likely it mixes tokens "
        "outside attention (a convolution, recurrence, pooling or cumulative op over the sequence) and is not "
        "CP-aware, so it saw only this rank's shard; or its attention does not go through "
        "F.scaled_dot_product_attention. Route it through cpcompose (cpcompose.mixers) or refuse CP for this model"
    )


def _float64_run(model: nn.Module, run: Callable[[list[Tensor]], None], values: list[Tensor],
                 full: _Recorder) -> _Recorder | None:
    """Every module's inputs and outputs on one process in float64, or None where the model cannot run in float64.

    A model already all float64 (parameters, buffers, floating inputs) has run in float64: `full` is that run.
    Local to each rank (no region, no collective), and the same model and inputs on every rank: every
    rank gets the same outcome, the None included.
    """
    tensors = [*model.parameters(), *model.buffers(), *values]
    if all(t.dtype == torch.float64 for t in tensors if t.is_floating_point()):
        return full
    if not castable(model):
        return None
    recorder = _Recorder(model)
    try:
        with in_float64(model):
            run([v.to(torch.float64) if v.is_floating_point() else v.clone() for v in values])
    except Exception:  # noqa: BLE001 - a kernel without float64: judged by the dtype's rounding instead
        return None
    finally:
        recorder.remove()
    return recorder
