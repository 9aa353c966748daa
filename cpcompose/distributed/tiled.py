"""A token-wise module run over sequence tiles with recompute (DeepSpeed ALST's TiledMLP).

An MLP's `seq x ffn_dim` intermediates (three of them in SwiGLU, kept for backward) cost more than
its input once the local sequence is long. A token-wise function commutes with cutting the
sequence, so `tiled_mlp` runs it a tile at a time without autograd and keeps only its input;
backward recomputes each tile with autograd on and backpropagates it before the next. At most one
tile's intermediates exist at once; the result and every gradient are the untiled ones, summed in
another order (parameter gradients over tiles, in float32 or wider). The price is one more forward
of the module per step. It is not CP-specific: it is trainer infrastructure like checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from cpcompose.comm import rehearsing
from cpcompose.precision import accumulation_dtype

__all__ = ["apply_tiled_mlp", "tiled", "tiled_mlp"]


def _tiles_of(x: Tensor, tiles: int, dim: int) -> list[Tensor]:
    """`x` cut into `tiles` views along `dim`, detached in a rehearsal (`comm.rehearsal_mode`): a memory tracker's
    module hooks would take the tiles forward cuts without autograd for autograd inputs (backward detaches its own).
    """
    cut = [t for t in x.tensor_split(tiles, dim=dim) if t.shape[dim] > 0]  # no empty tile when seq < tiles
    return [t.detach() for t in cut] if rehearsing() else cut


class _Tiled(torch.autograd.Function):
    """`fn(*inputs)` tile by tile, every input cut along its own dimension and every output put together along its
    own; the parameters are inputs so autograd sees their gradients (and FSDP/TP theirs)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], tiles: int, in_dims: tuple[int, ...], out_dims: tuple[int, ...],
                n_in: int, *tensors: Tensor) -> Tensor | tuple[Tensor, ...]:
        ctx.fn, ctx.tiles, ctx.in_dims, ctx.out_dims, ctx.n_in = fn, tiles, in_dims, out_dims, n_in
        device = tensors[0].device.type  # backward recomputes under the autocast its forward ran in
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*tensors)
        inputs = tensors[:n_in]
        outs: list[Tensor] = []
        start = 0
        for pieces in zip(*(_tiles_of(x, tiles, d) for x, d in zip(inputs, in_dims))):  # no autograd in here
            ys = _as_tuple(fn(*pieces))
            if not outs:
                length = inputs[0].shape[in_dims[0]]
                outs = [y.new_empty([length if i == d else n for i, n in enumerate(y.shape)])
                        for y, d in zip(ys, out_dims)]
            size = pieces[0].shape[in_dims[0]]
            for out, y, d in zip(outs, ys, out_dims):
                out.narrow(d, start, size).copy_(y)
            start += size
            del ys
        assert outs, "a tiled function needs a non-empty sequence"
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outs: Tensor) -> tuple[Tensor | None, ...]:
        tensors = ctx.saved_tensors
        inputs, params = tensors[: ctx.n_in], tensors[ctx.n_in :]
        want_in, want_params = ctx.needs_input_grad[5 : 5 + ctx.n_in], ctx.needs_input_grad[5 + ctx.n_in :]
        grad_in = [torch.empty_like(x) if w else None for x, w in zip(inputs, want_in)]
        grad_params: list[Tensor | None] = [None] * len(params)
        cut_in = [_tiles_of(x, ctx.tiles, d) for x, d in zip(inputs, ctx.in_dims)]
        cut_out = [_tiles_of(g, ctx.tiles, d) for g, d in zip(grad_outs, ctx.out_dims)]
        start = 0
        for pieces, grad_pieces in zip(zip(*cut_in), zip(*cut_out)):
            pieces = [p.detach().requires_grad_(w) for p, w in zip(pieces, want_in)]
            device, enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                ys = _as_tuple(ctx.fn(*pieces))
            wanted = [p for p, w in zip(pieces, want_in) if w] + [p for p, w in zip(params, want_params) if w]
            grads = list(torch.autograd.grad(ys, wanted, grad_pieces, allow_unused=True))
            del ys
            size = pieces[0].shape[ctx.in_dims[0]]
            for i in (i for i, w in enumerate(want_in) if w):
                g = grads.pop(0)
                if g is None:
                    grad_in[i].narrow(ctx.in_dims[i], start, size).zero_()
                else:
                    grad_in[i].narrow(ctx.in_dims[i], start, size).copy_(g)
            for i in (i for i, w in enumerate(want_params) if w):
                g = grads.pop(0)
                if g is None:
                    continue
                if grad_params[i] is None:
                    grad_params[i] = g.to(accumulation_dtype(g.dtype))  # summed over tiles, rounded once
                else:
                    grad_params[i] += g
            start += size
        cast = [None if g is None else g.to(p.dtype) for g, p in zip(grad_params, params)]
        return (None, None, None, None, None, *grad_in, *cast)


def _as_tuple(y: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return y if isinstance(y, tuple) else (y,)


def tiled(
    fn: Callable[..., Any],
    inputs: Sequence[tuple[Tensor, int]],
    tiles: int,
    *,
    out_dims: Sequence[int],
    params: Iterable[Tensor],
) -> Tensor | tuple[Tensor, ...]:
    """`fn(*inputs)`, computed over `tiles` slices of the sequence, with no whole intermediate kept.

    Each input is given with its sequence dimension, each output's sequence dimension is in `out_dims`; every
    input has the same sequence length. `fn` must be token-wise (each position's outputs depend on that position's
    inputs only) and deterministic (it runs again in backward). Forward keeps only the inputs; backward
    recomputes each tile and backpropagates it, summing parameter gradients over tiles.

    Args:
        fn: the token-wise function; returns one tensor or a tuple of them.
        inputs: `(tensor, sequence dimension)` pairs, the arguments of `fn` in order.
        tiles: slices of the sequence; 1 calls `fn` as it is.
        out_dims: the sequence dimension of each output.
        params: the tensors `fn` uses whose gradients are wanted; they must be the very tensors `fn` reads (under
            FSDP: called inside the unit's forward, where its parameters are the gathered ones).

    Raises:
        ValueError: `tiles < 1`, or inputs of different sequence lengths.
    """
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    if tiles == 1:
        return fn(*(x for x, _ in inputs))
    dims = tuple(d % x.dim() for x, d in inputs)
    lengths = {x.shape[d] for (x, _), d in zip(inputs, dims)}
    if len(lengths) != 1:
        raise ValueError(f"tiled inputs must share one sequence length, got {sorted(lengths)}")
    tensors = [x for x, _ in inputs] + [p for p in params if p.requires_grad]
    return _Tiled.apply(fn, tiles, dims, tuple(out_dims), len(inputs), *tensors)


def tiled_mlp(
    fn: Callable[[Tensor], Tensor],
    x: Tensor,
    tiles: int,
    *,
    seq_dim: int = 1,
    params: Iterable[Tensor] | None = None,
) -> Tensor:
    """`fn(x)`, computed over `tiles` slices of `x` along `seq_dim`, with no whole intermediate kept.

    `fn` must be token-wise along `seq_dim` (an MLP: each position's output depends on that position
    only) and deterministic (it runs again in backward). Forward keeps only `x`; backward recomputes
    each tile and backpropagates it, summing parameter gradients over tiles.

    Args:
        fn: the token-wise function, e.g. a feed-forward module.
        x: its input, e.g. `(batch, seq, dim)`.
        tiles: slices of the sequence; 1 calls `fn(x)` as it is. More tiles than positions make one a position.
        seq_dim: the sequence dimension of `x` (and of the output).
        params: the tensors `fn` uses whose gradients are wanted; by default `fn.parameters()` when `fn`
            is a module. They must be the very tensors `fn` reads (under FSDP: called inside the
            module's forward, where its parameters are the gathered ones).

    Returns:
        `fn(x)`.

    Raises:
        ValueError: `tiles < 1`.
    """
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    if tiles == 1:
        return fn(x)
    if params is None:
        params = fn.parameters() if isinstance(fn, nn.Module) else ()
    return tiled(fn, [(x, seq_dim)], tiles, out_dims=[seq_dim % x.dim()], params=params)


class _TiledForward:
    """Mixin: run the class's forward through `tiled_mlp` over `self._mlp_tiles` tiles of dim 1."""

    _mlp_tiles: int

    def forward(self, x: Tensor) -> Tensor:
        module: nn.Module = self  # type: ignore[assignment]
        forward = super().forward  # type: ignore[misc]
        return tiled_mlp(forward, x, self._mlp_tiles, seq_dim=1, params=module.parameters())


@functools.cache
def _tiled_class(cls: type) -> type:
    # One subclass per MLP class, so every MLP of a model shares it.
    return type(f"Tiled{cls.__name__}", (_TiledForward, cls), {})


def apply_tiled_mlp(mlps: Iterable[nn.Module], *, tiles: int) -> None:
    """Make each module compute its forward over `tiles` sequence tiles (dim 1 of its input), in place.

    As with activation checkpointing, the class is swapped, so FQNs and state dicts are unchanged; the
    modules must be token-wise and take one `(batch, seq, ...)` tensor. `tiles == 1` leaves them as
    they are; applying it again changes the tile count.

    Raises:
        ValueError: `tiles < 1`.
    """
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    for mlp in mlps:
        if tiles == 1:
            continue
        if not isinstance(mlp, _TiledForward):
            mlp.__class__ = _tiled_class(type(mlp))
        mlp._mlp_tiles = tiles  # type: ignore[attr-defined]
