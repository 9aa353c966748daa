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
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cpcompose.comm import rehearsing
from cpcompose.precision import accumulation_dtype

__all__ = ["apply_tiled_mlp", "tiled_mlp"]


def _tiles_of(x: Tensor, tiles: int, dim: int) -> list[Tensor]:
    """`x` cut into `tiles` views along `dim`, detached in a rehearsal (`comm.rehearsal_mode`): a memory tracker's
    module hooks would take the tiles forward cuts without autograd for autograd inputs (backward detaches its own).
    """
    cut = [t for t in x.tensor_split(tiles, dim=dim) if t.shape[dim] > 0]  # no empty tile when seq < tiles
    return [t.detach() for t in cut] if rehearsing() else cut


class _TiledMLP(torch.autograd.Function):
    """`fn(x)` tile by tile; the parameters are inputs so autograd sees their gradients (and FSDP/TP theirs)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[Tensor], Tensor], tiles: int, dim: int, x: Tensor, *params: Tensor) -> Tensor:
        ctx.fn, ctx.tiles, ctx.dim = fn, tiles, dim
        ctx.save_for_backward(x, *params)
        out: Tensor | None = None
        start = 0
        for piece in _tiles_of(x, tiles, dim):  # Function.forward runs without autograd: nothing is kept
            y = fn(piece)
            if out is None:
                shape = list(y.shape)
                shape[dim] = x.shape[dim]
                out = y.new_empty(shape)
            out.narrow(dim, start, piece.shape[dim]).copy_(y)
            start += piece.shape[dim]
            del y
        assert out is not None, "tiled_mlp needs a non-empty sequence"
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, *params = ctx.saved_tensors
        want_x, want_params = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        grad_x = torch.empty_like(x) if want_x else None
        grad_params: list[Tensor | None] = [None] * len(params)
        start = 0
        for piece, grad_piece in zip(_tiles_of(x, ctx.tiles, ctx.dim), _tiles_of(grad_out, ctx.tiles, ctx.dim)):
            piece = piece.detach().requires_grad_(want_x)
            with torch.enable_grad():
                y = ctx.fn(piece)
            wanted = ([piece] if want_x else []) + [p for p, w in zip(params, want_params) if w]
            grads = list(torch.autograd.grad(y, wanted, grad_piece, allow_unused=True))
            del y
            if want_x:
                grad_x.narrow(ctx.dim, start, piece.shape[ctx.dim]).copy_(grads.pop(0))
            for i in (i for i, w in enumerate(want_params) if w):
                g = grads.pop(0)
                if g is None:
                    continue
                if grad_params[i] is None:
                    grad_params[i] = g.to(accumulation_dtype(g.dtype))  # summed over tiles, rounded once
                else:
                    grad_params[i] += g
            start += piece.shape[ctx.dim]
        cast = [None if g is None else g.to(p.dtype) for g, p in zip(grad_params, params)]
        return (None, None, None, grad_x, *cast)


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
    dim = seq_dim % x.dim()
    return _TiledMLP.apply(fn, tiles, dim, x, *[p for p in params if p.requires_grad])


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
