"""`CPOptions`: how CP attention is computed, one object from the config to the kernel call.

The trainer builds one from its config, `parallelize` hands it to `ContextParallel`,
the style hands it to the SDPA route, and the route hands it to `cp_attention`:
nobody re-threads its fields by hand, so a new option is one field here. It is
checked where it is used, through the cross-rank agreement, so a bad value on one
rank raises on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from cpcompose.comm import CommMeter
from cpcompose.layouts import LayoutSpec, layout_error

Strategy = Literal["ring", "allgather", "alltoall"]
STRATEGY_NAMES: tuple[str, ...] = ("ring", "allgather", "alltoall")
Validate = Literal["first_call", "every_call"]
VALIDATE_MODES: tuple[str, ...] = ("first_call", "every_call")


@dataclass(frozen=True)
class CPOptions:
    """The CP attention options shared by every entry point.

    Attributes:
        strategy: "ring" (K/V point-to-point), "allgather" (gather K/V) or
            "alltoall" (Ulysses: heads for sequence).
        layout: how the shards were cut: a registered name ("zigzag", the default,
            or "contiguous") or a `Layout` object such as a `PackedLayout`.
        window_size: sliding window: an int W (causal: each query sees W positions to
            its left) or flash-attn's `(left, right)` pair (-1 = unbounded), checked
            per call against the mask (see `cp_attention`).
        backend: force a local kernel (see `kernels.BACKENDS`); None = best available.
        meter: counts the bytes CP attention sends.
        validate: "first_call" (the default): the blocking cross-rank agreement runs
            when a call differs from the one every rank expects (the first call, new
            shapes or options), not on repeats; "every_call": on every call, a debug
            mode that catches a rank changing its inputs alone on any device (see
            `cpcompose.attention.agreement`). Must be the same on every rank.
    """

    strategy: Strategy = "ring"
    layout: LayoutSpec = None
    window_size: int | tuple[int, int] | None = None
    backend: str | None = None
    meter: CommMeter | None = None
    validate: Validate = "first_call"

    def replace(self, **changes: Any) -> "CPOptions":
        """A copy with `changes` (TypeError names an unknown option, as a function call would)."""
        return dataclasses.replace(self, **changes) if changes else self

    def error(self, world: int) -> str | None:
        """Why these options cannot run on a CP group of `world` ranks, or None."""
        if self.strategy not in STRATEGY_NAMES:
            return f"strategy={self.strategy!r} is unknown; choose one of {STRATEGY_NAMES}"
        if self.meter is not None and not isinstance(self.meter, CommMeter):
            return f"meter must be a cpcompose.CommMeter, got {type(self.meter).__name__}"
        if self.validate not in VALIDATE_MODES:
            return f"validate={self.validate!r} is unknown; choose one of {VALIDATE_MODES}"
        return layout_error(self.layout, world)
