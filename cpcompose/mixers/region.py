"""What a CP mixer kernel reads of the region it runs in: the mesh, the split, the byte meter.

The kernel-API versions in this package (`mamba_ssm`, `fla`, `causal_conv1d`,
`transformers_models`) are called as `cp(original, region, *the kernel's own arguments)`.
Inside `cpcompose.context_parallel` the transformers integration passes its active region;
a caller of the kernels themselves (a torchtitan model, a script calling
flash-linear-attention's API) passes a `MixerRegion`. Both satisfy `Region`, so this
package never imports the layers above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter
from cpcompose.layouts import Layout, LayoutSpec, layout_error, resolve_layout

__all__ = ["MixerOptions", "MixerRegion", "Region", "RegionOptions"]


class RegionOptions(Protocol):
    """The options a mixer reads: how the shards were cut and where the bytes are counted."""

    @property
    def layout(self) -> LayoutSpec: ...

    @property
    def meter(self) -> CommMeter | None: ...

    def error(self, world: int) -> str | None:
        """Why these options cannot run over `world` ranks, or None."""
        ...


class Region(Protocol):
    """A CP region as the mixers see it (`cpcompose.parallel.dispatch.CPAttentionMode` is one)."""

    @property
    def mesh(self) -> DeviceMesh: ...

    @property
    def options(self) -> RegionOptions: ...

    def layout(self) -> Layout | None:
        """The region's split, or None if the options name none (the agreement then reports why)."""
        ...


@dataclass(frozen=True)
class MixerOptions:
    """`RegionOptions` for a direct call: the layout ("zigzag" by default) and an optional byte meter."""

    layout: LayoutSpec = None
    meter: CommMeter | None = None

    def error(self, world: int) -> str | None:
        return layout_error(self.layout, world)


@dataclass(frozen=True)
class MixerRegion:
    """A `Region` without transformers or a `context_parallel` block: `MixerRegion(mesh, MixerOptions("zigzag"))`."""

    mesh: DeviceMesh
    options: MixerOptions = field(default_factory=MixerOptions)

    def layout(self) -> Layout | None:
        world = self.mesh.size()
        return None if self.options.error(world) else resolve_layout(self.options.layout, world)
