"""Layout names, the default, and the one resolver from a user's spelling to a `Layout`.

Every entry point (sharding, positions, attention, the SDPA route, the style, the
context manager, the trainer) resolves its `layout=` argument here and nowhere
else, so they cannot disagree on what a name or the default means. A new layout
that can be built from the group size alone is one file plus one line in `LAYOUTS`;
a layout built from data (the packed split) is passed as the object itself.
"""

from __future__ import annotations

from typing import Callable, Union

from cpcompose.layouts.base import Layout
from cpcompose.layouts.contiguous import ContiguousLayout
from cpcompose.layouts.zigzag import ZigzagLayout

__all__ = ["DEFAULT_LAYOUT", "LAYOUTS", "LayoutSpec", "layout_error", "resolve_layout"]

LAYOUTS: dict[str, Callable[[int], Layout]] = {
    "zigzag": ZigzagLayout,
    "contiguous": ContiguousLayout,
}
"""Layouts by name, each built from the CP group size."""

DEFAULT_LAYOUT = "zigzag"
"""What `layout=None` means everywhere: balanced causal work, exact for every mask."""

LayoutSpec = Union[str, Layout, None]
"""How users name a split: a registered name, a `Layout` object (e.g. a `PackedLayout`), or None."""


def layout_error(spec: object, world: int) -> str | None:
    """Why `spec` names no layout over `world` ranks, or None."""
    if spec is None or (isinstance(spec, str) and spec in LAYOUTS):
        return None
    if isinstance(spec, Layout):
        if spec.world != world:
            return (
                f"the {spec.name} layout was built for {spec.world} CP ranks but the CP mesh has {world}; "
                "build it for the mesh you attend on"
            )
        return None
    return f"layout={spec!r} is unknown; choose one of {tuple(LAYOUTS)} or pass a Layout such as a PackedLayout"


def resolve_layout(spec: LayoutSpec, world: int) -> Layout:
    """The `Layout` that `spec` names over a CP group of `world` ranks.

    Raises:
        ValueError: an unknown name, or a layout object built for another group size.
    """
    error = layout_error(spec, world)
    if error:
        raise ValueError(error)
    if isinstance(spec, Layout):
        return spec
    return LAYOUTS[spec if spec is not None else DEFAULT_LAYOUT](world)
