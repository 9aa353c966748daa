"""`ContextParallel`: the ParallelStyle that makes a module's SDPA calls context-parallel."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from cpcompose.comm import CommMeter
from cpcompose.packing import PackedLayout
from cpcompose.parallel.dispatch import CPAttentionMode, CPConfig


class ContextParallel(ParallelStyle):
    """Run the module's forward inside a `CPAttentionMode` on the CP mesh.

    `parallelize_module(model, cp_mesh, {"layers.*.attention": ContextParallel()})`
    leaves the model's code untouched: its `F.scaled_dot_product_attention` calls
    become ring / all-gather / all-to-all attention over the local shards. The
    rest of the model runs on the local shards as it is.

    Args (keyword-only):
        strategy: "ring", "allgather" or "alltoall".
        layout: how the sequence was sharded: "zigzag" (default) or "contiguous".
        seq_dim: sequence dim of the module's tensor inputs and outputs.
        use_local_output: when inputs arrive as DTensors (`Shard(seq_dim)` on the CP
            mesh), return a plain local tensor (True) or a DTensor like the input.
        meter: counts the bytes CP attention sends.
        backend: force a local attention kernel (tests).
        window_size: sliding window of the (causal) SDPA calls, in positions to the left.

    For packed sequences the layout changes with every batch: wrap the forward
    *and* backward in `with style.layout_for(packed_layout):` (a recompute under
    activation checkpointing must see the same layout).
    """

    def __init__(
        self,
        *,
        strategy: str = "ring",
        layout: str = "zigzag",
        seq_dim: int = 1,
        use_local_output: bool = True,
        meter: CommMeter | None = None,
        backend: str | None = None,
        window_size: int | None = None,
    ) -> None:
        super().__init__()
        self.strategy, self.layout, self.seq_dim = strategy, layout, seq_dim
        self.use_local_output, self.meter, self.backend = use_local_output, meter, backend
        self.window_size = window_size
        self._configs: dict[int, CPConfig] = {}  # per mesh this style was applied on
        self._override: str | PackedLayout | None = None

    @contextlib.contextmanager
    def layout_for(self, layout: str | PackedLayout) -> Iterator[None]:
        """Use `layout` (e.g. this batch's `PackedLayout`) for the forward passes inside."""
        previous, self._override = self._override, layout
        try:
            yield
        finally:
            self._override = previous

    def _config(self, mesh: DeviceMesh) -> CPConfig:
        config = self._configs[id(mesh)]
        return config if self._override is None else dataclasses.replace(config, layout=self._override)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(strategy={self.strategy!r}, layout={self.layout!r}, "
            f"seq_dim={self.seq_dim}, use_local_output={self.use_local_output}, window_size={self.window_size})"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._configs[id(device_mesh)] = CPConfig(
            device_mesh, self.strategy, self.layout, self.meter, self.backend, self.window_size
        )
        active: list[tuple[CPAttentionMode, DTensor | None]] = []  # re-entrant (recursion, recompute)

        def enter(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            template = next((a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)), None)
            if template is not None:
                args = tuple(self._to_local(a) for a in args)
                kwargs = {k: self._to_local(a) for k, a in kwargs.items()}
            mode = CPAttentionMode(self._config(device_mesh))
            mode.__enter__()
            active.append((mode, template))
            return args, kwargs

        def leave(_module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
            mode, template = active.pop()
            mode.__exit__(None, None, None)
            if template is None or self.use_local_output:
                return output
            return DTensor.from_local(output, template.device_mesh, template.placements, run_check=False)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, always_call=True)
        return module

    def _to_local(self, x: Any) -> Any:
        if not isinstance(x, DTensor):
            return x
        if not any(isinstance(p, Shard) and p.dim % x.ndim == self.seq_dim % x.ndim for p in x.placements):
            raise ValueError(
                f"ContextParallel got a DTensor input with placements {x.placements}; it expects "
                f"Shard({self.seq_dim}) (the sequence) on the CP mesh, or a plain local shard"
            )
        return x.to_local()
