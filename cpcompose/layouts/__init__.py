"""How a sequence is cut across the ranks of a CP group: one protocol, one resolver."""

from cpcompose.layouts.base import Layout, Run
from cpcompose.layouts.chunked import ChunkedLayout
from cpcompose.layouts.contiguous import ContiguousLayout
from cpcompose.layouts.packed import BALANCES, PackedLayout, cu_seqlens_error
from cpcompose.layouts.positions import position_ids_error
from cpcompose.layouts.registry import DEFAULT_LAYOUT, LAYOUTS, LayoutSpec, layout_error, resolve_layout
from cpcompose.layouts.zigzag import ZigzagLayout

__all__ = [
    "BALANCES",
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "ChunkedLayout",
    "ContiguousLayout",
    "Layout",
    "LayoutSpec",
    "PackedLayout",
    "Run",
    "ZigzagLayout",
    "cu_seqlens_error",
    "layout_error",
    "position_ids_error",
    "resolve_layout",
]
