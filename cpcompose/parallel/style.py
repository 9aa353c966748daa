"""`ContextParallel`: the ParallelStyle that makes a module's SDPA calls context-parallel."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from cpcompose.attention.call.op import CPContext
from cpcompose.attention.call.options import CPOptions
from cpcompose.sharding.dtensor import split_mismatch
from cpcompose.layouts import LayoutSpec
from cpcompose.parallel.dispatch import CPAttentionMode

__all__ = ["ContextParallel"]


class ContextParallel(ParallelStyle):
    """Run the module's forward inside a `CPAttentionMode` on the CP mesh.

    `parallelize_module(model, cp_mesh, {"layers.*.attention": ContextParallel()})`
    leaves the model's code untouched: its `F.scaled_dot_product_attention` calls
    become ring / all-gather / all-to-all attention over the local shards. The
    rest of the model runs on the local shards as it is.

    Args:
        options: the `CPOptions` (strategy, layout, window_size, backend, meter).
        seq_dim: (keyword) sequence dim of the module's tensor inputs and outputs.
        use_local_output: (keyword) when inputs arrive as DTensors (`Shard(seq_dim)`
            on the CP mesh, in the layout's order: see `cp_distribute`), return a
            plain local tensor (True) or a DTensor like the input.
        **overrides: any `CPOptions` field by name, e.g. `strategy="alltoall"`.

    For packed sequences the layout changes with every batch: wrap the forward
    *and* backward in `with style.layout_for(packed_layout):` (a recompute under
    activation checkpointing must see the same layout).
    """

    def __init__(
        self, options: CPOptions | None = None, *, seq_dim: int = 1, use_local_output: bool = True, **overrides: Any
    ) -> None:
        super().__init__()
        self.options = (options or CPOptions()).replace(**overrides)
        self.seq_dim, self.use_local_output = seq_dim, use_local_output
        self._layout_override: LayoutSpec = None

    @contextlib.contextmanager
    def layout_for(self, layout: LayoutSpec) -> Iterator[None]:
        """Use `layout` (e.g. this batch's `PackedLayout`) for the forward passes inside."""
        previous, self._layout_override = self._layout_override, layout
        try:
            yield
        finally:
            self._layout_override = previous

    def recompute_context(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """`torch.utils.checkpoint`'s `context_fn` for blocks holding this style's attention: nothing around the
        forward, and around the recomputation the `layout_for` layout the forward ran under. A pipeline schedule
        runs a microbatch's backward (so its recomputation) outside the scope its forward ran in. The recompute
        context may be entered more than once: a zero-bubble schedule's split backward recomputes in its input
        part and again in its weight part."""
        return contextlib.nullcontext(), _Reentrant(self, self._layout_override)

    def current_options(self) -> CPOptions:
        """The options a forward entered now uses (with any `layout_for` override)."""
        if self._layout_override is None:
            return self.options
        return self.options.replace(layout=self._layout_override)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.options!r}, seq_dim={self.seq_dim}, "
            f"use_local_output={self.use_local_output})"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        active: list[tuple[CPAttentionMode, DTensor | None]] = []  # re-entrant (recursion, recompute)
        # Made here, outside any compiled code, and kept as long as the hooks: the compiled
        # route hands it to the custom op by reference (see cpcompose.attention.call.op).
        context = CPContext(device_mesh, self.current_options)

        def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            mode = CPAttentionMode(device_mesh, self.current_options(), context)
            template = next((a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)), None)
            if template is not None:
                args = tuple(self._to_local(a, mode) for a in args)
                kwargs = {k: self._to_local(a, mode) for k, a in kwargs.items()}
            mode.__enter__()
            active.append((mode, template))
            return args, kwargs

        def leave(_module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
            mode, template = active.pop()
            mode.__exit__(None, None, None)
            mode.check_routed(f"ContextParallel on {type(_module).__name__}")
            if template is None or self.use_local_output:
                return output
            return DTensor.from_local(output, template.device_mesh, template.placements, run_check=False)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
        return module

    def _to_local(self, x: Any, mode: CPAttentionMode) -> Any:
        if not isinstance(x, DTensor):
            return x
        if not any(isinstance(p, Shard) and p.dim % x.ndim == self.seq_dim % x.ndim for p in x.placements):
            raise ValueError(
                f"ContextParallel got a DTensor input with placements {x.placements}; it expects "
                f"Shard({self.seq_dim}) (the sequence) on the CP mesh, or a plain local shard"
            )
        layout = mode.layout()
        error = None if layout is None else split_mismatch(x, layout, what="ContextParallel input")
        if error:
            raise ValueError(error)
        return x.to_local()


class _Reentrant:
    """`style.layout_for(layout)` as a context manager that can be entered again after it exits."""

    def __init__(self, style: ContextParallel, layout: LayoutSpec) -> None:
        self._style, self._layout = style, layout
        self._open: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        scope = self._style.layout_for(self._layout)
        scope.__enter__()
        self._open.append(scope)

    def __exit__(self, *exc: object) -> None:
        self._open.pop().__exit__(*exc)
