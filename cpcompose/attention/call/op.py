"""CP attention as two `torch.library` custom ops, so `torch.compile` sees one opaque call.

Eager CP attention is Python all the way down: the cross-rank agreement reads an
all-gathered tensor with `.tolist()` and branches on it, and the strategies post
point-to-point messages in loops. Dynamo cannot trace that (`GuardOnDataDependentSymNode`
in `fullgraph=True`). Under `torch.compile` the SDPA route therefore calls
`cpcompose::attention` instead, whose implementation is the eager code (checks,
agreement, strategy) and whose fake implementation gives only shapes; its backward
is `cpcompose::attention_backward`, wired with `register_autograd`.

What dynamo sees: `(out, lse, residuals) = cpcompose::attention(q, k, v, context, strategy, alltoall_size, ...)`
with tensor inputs (the caller's `position_ids` too, checked inside), a `CPContext` and a few constants (a
layer's own window among them); in backward,
`(dq, dk, dv) = cpcompose::attention_backward(dout, q, k, v, out, lse, residuals, context, ...)`.

Non-tensor arguments cross the boundary in a `CPContext`, a torch opaque object
*by reference*: compile passes the very object into the op as a graph input, so the
op reads the mesh and the *current* options (a `layout_for` override included) at
run time. Its owner gives its lifetime: a `ContextParallel` style creates one in
`_apply` (it lives as long as the style's hooks), `context_parallel` one per region.
Nothing is kept in a module-level registry.

The strategies' `autograd.Function`s are driven directly: their `forward` runs with a
`_SavedContext` that records what it saves. Ring and all-gather save `q, k, v, out, lse`,
which the backward op gets anyway; all-to-all and 2-D ("alltoall_ring") save
head-sharded copies, which travel as `residuals` (no recomputation, no extra
communication). The strategy and the 2-D block size shape those residuals, so they
are read at trace time and passed to the op as constants.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose._compat import CustomClassBase, register_by_reference
from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.call.orchestrate import checked_call, setup_for, tensor_error
from cpcompose.attention.local.heads import head_plan, kv_head_ranges, query_head_ranges
from cpcompose.attention.call.options import AUTO, CPOptions
from cpcompose.attention.strategies.registry import STRATEGIES
from cpcompose.attention.strategies.strategy import Strategy
from cpcompose.comm import CPGroup, rehearsing
from cpcompose.layouts import position_ids_error, resolve_layout
from cpcompose.precision import accumulation_dtype

__all__ = ["CPContext", "compiled_attention"]


class CPContext(CustomClassBase):
    """The CP mesh and options of a CP region, handed to the custom ops by reference.

    Make it outside compiled code (dynamo cannot create one) and keep it as long as the
    compiled code runs: `ContextParallel` and `context_parallel` make their own;
    `cp_attention` inside `torch.compile` takes one as `mesh=`.

    Args:
        mesh: the 1-D CP mesh.
        options: the `CPOptions`, or a function returning the options to use now (a
            style's `current_options`, so a per-batch `layout_for` reaches compiled code
            without a recompile); `**overrides` sets fields of fixed options by name.
    """

    def __init__(
        self, mesh: DeviceMesh, options: CPOptions | Callable[[], CPOptions] | None = None, **overrides: Any
    ) -> None:
        cp = CPGroup.from_mesh(mesh)
        if callable(options):
            if overrides:
                raise TypeError("CPContext takes overrides only with fixed options, not with a callable")
            self.options: Callable[[], CPOptions] = options
        else:
            fixed = (options or CPOptions()).replace(**overrides)
            self.options = lambda: fixed
        self.mesh = mesh
        self.world, self.rank = cp.world, cp.rank
        self.calls = 0  # attention calls the op ran with this context (at run time, unseen by dynamo)

    @property
    def strategy(self) -> str:
        """The strategy now: it decides the custom op's saved tensors, so compiled code reads it at trace time."""
        return self.options().strategy

    @property
    def alltoall_size(self) -> int | None:
        """The 2-D all-to-all block size now (it shapes the saved head shards too); read at trace time."""
        return self.options().alltoall_size


    @property
    def head_chunks(self) -> int:
        """All-to-all's chunks of heads now: the op runs one chunk only (see `compiled_attention`); read at trace
        time."""
        return self.options().head_chunks


# Read at trace time with the real object and baked in as constants (the fake op needs
# all-to-all's head split); everything else is read by the op's eager implementation.
register_by_reference(CPContext, read_at_trace=("world", "rank", "strategy", "alltoall_size", "head_chunks"))


class _SavedContext:
    """Stands in for an autograd ctx: records what a strategy's `forward` saves."""

    def __init__(self) -> None:
        self.saved_tensors: tuple[Tensor, ...] = ()

    def save_for_backward(self, *tensors: Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *_tensors: Tensor) -> None:
        pass  # the op's autograd formula gives the LSE no gradient


def _head_sharded(strategy: str) -> bool:
    """Whether the strategy's saved tensors are head shards, which travel as the op's residuals."""
    return strategy in STRATEGIES and STRATEGIES[strategy].saves == "head_shards"


def _options(context: CPContext, strategy: str, alltoall_size: int | None, window_size: list[int] | None) -> Any:
    """The context's options now, with the call's own window (a layer's: a constant of the traced call)."""
    options = context.options()
    if window_size is not None:
        options = options.replace(window_size=window_size[0] if len(window_size) == 1 else tuple(window_size))
    if options.strategy != strategy or _size_code(options.alltoall_size) != alltoall_size:  # traced with others
        raise ValueError(
            f"cp_attention was compiled for strategy={strategy!r}, alltoall_size={alltoall_size!r}; "
            "recompile to change them"
        )
    return options


def _window_code(window_size: object) -> list[int] | None:
    """A window as the op's `int[]?` argument: `W` as `[W]`, `(left, right)` as a pair; a value of another type as
    `[-1]` (the options' checks name it: every rank raises)."""
    if window_size is None:
        return None
    if isinstance(window_size, int) and not isinstance(window_size, bool):
        return [window_size]
    if isinstance(window_size, tuple) and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        return list(window_size)
    return [-1]


def _size_code(alltoall_size: object) -> int | None:
    """`alltoall_size` as the op's `int | None` argument; -1 for a value of another type (the op's checks name it)."""
    if alltoall_size is None or (isinstance(alltoall_size, int) and not isinstance(alltoall_size, bool)):
        return alltoall_size
    return -1


def _head_block(strategy: str, alltoall_size: int | None, world: int, rank: int) -> tuple[int, int]:
    """(ranks that trade heads, this rank's place among them) of a head-sharded strategy.

    A size the strategy cannot use (the real op raises on every rank) gives the whole
    group, so the fake still has shapes to trace with.
    """
    try:
        size = STRATEGIES[strategy].block_size(world, alltoall_size)
    except (KeyError, ValueError, TypeError):
        size = world
    return size, rank % size


def _strategy(name: str) -> Strategy:
    return STRATEGIES[name]


def _unaliased(outputs: list[Tensor], inputs: tuple[Tensor, ...]) -> list[Tensor]:
    """`outputs`, each copied only if it shares memory with an input or an earlier output.

    A custom op's outputs may not alias its inputs or each other (torch checks at run
    time), but the strategies return views: all-gather's dK and dV are two halves of one
    reduce-scatter buffer, and a dtype cast to the same dtype returns its input. Empty
    tensors are always copied (free): their storages all report address 0.
    """
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    fresh = []
    for t in outputs:
        address = t.untyped_storage().data_ptr()
        if not t.numel() or address in seen:
            t = t.clone()
            address = t.untyped_storage().data_ptr()
        seen.add(address)
        fresh.append(t)
    return fresh


@torch.library.custom_op("cpcompose::attention", mutates_args=())
def _attention(
    q: Tensor, k: Tensor, v: Tensor, context: CPContext, strategy: str, alltoall_size: int | None, is_causal: bool,
    scale: float | None, softcap: float | None, return_lse: bool, caller_error: str | None,
    position_ids: Tensor | None, window_size: list[int] | None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    context.calls += 1  # a CP region entered outside compiled code counts its routed calls here (no guard)

    def forward(setup: AttentionSetup) -> tuple[Tensor, Tensor, list[Tensor]]:
        saved = _SavedContext()
        out, lse = _strategy(strategy).function.forward(saved, q, k, v, setup)
        residuals = [t.contiguous() for t in saved.saved_tensors] if _head_sharded(strategy) else []
        fresh = _unaliased([out.contiguous(), lse.contiguous(), *residuals], (q, k, v))  # contiguous: as the fake
        return fresh[0], fresh[1], fresh[2:]

    options = _options(context, strategy, alltoall_size, window_size)
    if caller_error is None and position_ids is not None:
        caller_error = _position_error(position_ids, options, context, q.shape[2])
    return checked_call(
        q, k, v, mesh=context.mesh, is_causal=is_causal, scale=scale, options=options, softcap=softcap,
        return_lse=return_lse, caller_error=caller_error, run=forward,
    )


def _position_error(position_ids: Tensor, options: CPOptions, context: CPContext, local_len: int) -> str | None:
    """The caller's positions against the region's split (read now: a packed layout changes per batch), or None.

    Not in a rehearsal (fake tensors have no values), nor with options whose split is not known (their own
    error is named by the checks)."""
    if rehearsing() or options.error(context.world):
        return None
    layout = resolve_layout(options.layout, context.world)
    return position_ids_error(position_ids, layout, context.rank, local_len)


@_attention.register_fake
def _attention_fake(
    q: Tensor, k: Tensor, v: Tensor, context: Any, strategy: str, alltoall_size: int | None, is_causal: bool,
    scale: float | None, softcap: float | None, return_lse: bool, caller_error: str | None,
    position_ids: Tensor | None, window_size: list[int] | None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    if tensor_error(q, k, v) is not None:  # the real op raises on every rank; any shape will do
        return q.new_empty(q.shape), q.new_empty(0), []
    b, h, s, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    out = q.new_empty((b, h, s, v.shape[3]))
    if not _head_sharded(strategy):
        return out, q.new_empty((b, h, s), dtype=acc), []
    lse = q.new_empty((b, h, s) if return_lse else (0,), dtype=acc)
    size, index = _head_block(strategy, alltoall_size, context.world, context.rank)
    return out, lse, _head_residuals(q, k, v, size, index)


def _head_residuals(q: Tensor, k: Tensor, v: Tensor, size: int, index: int) -> list[Tensor]:
    """Empty tensors shaped like what `AllToAllAttention.forward` (size: the world) or
    `AllToAllRingAttention.forward` (size: alltoall_size) saves at place `index` of its block."""
    q_ranges = query_head_ranges(q.shape[1], size)
    (lo, hi), (klo, khi) = q_ranges[index], kv_head_ranges(q_ranges, q.shape[1] // k.shape[1])[index]
    b, length = q.shape[0], q.shape[2] * size
    return [
        q.new_empty((b, hi - lo, length, q.shape[3])),
        k.new_empty((b, khi - klo, length, k.shape[3])),
        v.new_empty((b, khi - klo, length, v.shape[3])),
        q.new_empty((b, hi - lo, length, v.shape[3])),
        q.new_empty((b, hi - lo, length), dtype=accumulation_dtype(q.dtype)),
    ]


@torch.library.custom_op("cpcompose::attention_backward", mutates_args=())
def _attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, residuals: list[Tensor],
    context: CPContext, strategy: str, alltoall_size: int | None, is_causal: bool, scale: float | None,
    softcap: float | None, return_lse: bool, window_size: list[int] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    # The forward agreed on this call: the backward only rebuilds its setup (no communication).
    setup = setup_for(q, mesh=context.mesh, is_causal=is_causal, scale=scale, softcap=softcap,
                      options=_options(context, strategy, alltoall_size, window_size), return_lse=return_lse)
    ctx = _SavedContext()
    ctx.setup = setup  # type: ignore[attr-defined]
    if _head_sharded(strategy):
        ctx.saved_tensors = tuple(residuals)
        size, index = _head_block(strategy, alltoall_size, setup.cp.world, setup.cp.rank)
        plan = head_plan(q.shape[1], k.shape[1], size, index, q.device)
        ctx.plan, ctx.n_kv = plan, k.shape[1]  # type: ignore[attr-defined]
    else:
        ctx.saved_tensors = (q, k.contiguous(), v.contiguous(), out, lse)
    dq, dk, dv, _ = _strategy(strategy).function.backward(ctx, dout, None)
    dq, dk, dv = _unaliased([dq.contiguous(), dk.contiguous(), dv.contiguous()], (dout, q, k, v, out, lse, *residuals))
    return dq, dk, dv


@_attention_backward.register_fake
def _attention_backward_fake(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, residuals: list[Tensor],
    context: Any, strategy: str, alltoall_size: int | None, is_causal: bool, scale: float | None,
    softcap: float | None, return_lse: bool, window_size: list[int] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, context, strategy, alltoall_size, is_causal, scale, softcap, return_lse, _error, _positions, window = (
        inputs)
    out, lse, residuals = output
    ctx.save_for_backward(q, k, v, out, lse, *residuals)
    ctx.args = (context, strategy, alltoall_size, is_causal, scale, softcap, return_lse, window)


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor, _dresiduals: list[Tensor]) -> tuple:
    q, k, v, out, lse, *residuals = ctx.saved_tensors
    dq, dk, dv = _attention_backward(dout.contiguous(), q, k, v, out, lse, residuals, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(
    q: Tensor, k: Tensor, v: Tensor, *, context: CPContext, is_causal: bool, scale: float | None,
    softcap: float | None = None, return_lse: bool = False, caller_error: str | None = None,
    position_ids: Tensor | None = None, window_size: int | tuple[int, int] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`attend` through the custom op: what `cp_attention` and the SDPA route call while dynamo traces.

    Args:
        context: the `CPContext` (made outside the traced code: dynamo cannot build one).
        caller_error: the route's own complaint, joined to the agreement inside the op.
        position_ids: the caller's positions of this rank's tokens, checked inside the op against the
            options' split (`position_ids_error`; a data-dependent check dynamo cannot trace), or None.
        window_size: this call's sliding window (a Hugging Face layer's), in place of the context's; None: the
            context's.
    """
    strategy, alltoall_size = context.strategy, _size_code(context.alltoall_size)  # trace time: residual shapes
    if strategy == AUTO:  # the same options on every rank, so every rank raises this while tracing
        raise ValueError(
            "strategy='auto' is not supported inside torch.compile yet (the choice is made per call in eager "
            "code): run a step eagerly, read the 'cp strategy auto ->' log line, and compile with that strategy"
        )
    if context.head_chunks != 1:  # its saved tensors are the inputs, not the head shards the op expects
        raise ValueError(
            "head_chunks > 1 (parallelism.cp_head_chunks) is not supported inside torch.compile yet: run the "
            "attention eagerly (training.compile = false), or set head_chunks = 1"
        )
    out, lse, _ = _attention(
        q, k, v, context, strategy, alltoall_size, is_causal, scale, softcap, return_lse, caller_error, position_ids,
        _window_code(window_size),
    )
    return (out, lse) if return_lse else out
