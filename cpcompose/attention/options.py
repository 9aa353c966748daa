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

Strategy = Literal["ring", "allgather", "alltoall", "alltoall_ring", "auto"]
STRATEGY_NAMES: tuple[str, ...] = ("ring", "allgather", "alltoall", "alltoall_ring")  # the ones that run
AUTO = "auto"  # the cost model picks one of STRATEGY_NAMES per call (`cpcompose.attention.auto`)
CHOICES: tuple[str, ...] = (*STRATEGY_NAMES, AUTO)
Validate = Literal["first_call", "every_call"]
VALIDATE_MODES: tuple[str, ...] = ("first_call", "every_call")


@dataclass(frozen=True)
class CPOptions:
    """The CP attention options shared by every entry point.

    Attributes:
        strategy: "ring" (K/V point-to-point), "allgather" (gather K/V),
            "alltoall" (Ulysses: heads for sequence) or "alltoall_ring" (2-D: Ulysses
            inside blocks of `alltoall_size` consecutive ranks, a ring across the blocks),
            or "auto": the cost model (`cpcompose.attention.cost`) picks one of those, and the
            2-D block size, for each call signature, the same on every rank.
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
        alltoall_size: "alltoall_ring" only (and required there): ranks per all-to-all
            block, a divisor of the CP size P; the ring runs over the P / alltoall_size
            blocks. Consecutive ranks form a block, so under torchrun a block that fits
            in a node keeps the all-to-all on the node's fast links. alltoall_size=P is
            Ulysses, 1 is the ring.
        calibration: "auto" only: the machine constants of the cost model (a
            `cpcompose.attention.cost.Calibration`, e.g. loaded from the JSON of
            `scripts/calibrate_cost_model.py`); None = the shipped defaults for the
            device type. Its fingerprint joins the agreement: every rank must use the same.
        topology: "auto" only: which CP ranks share a node (`cpcompose.attention.cost.Topology`);
            None = LOCAL_WORLD_SIZE ranks per node when torchrun sets it, else one node.
    """

    strategy: Strategy = "ring"
    layout: LayoutSpec = None
    window_size: int | tuple[int, int] | None = None
    backend: str | None = None
    meter: CommMeter | None = None
    validate: Validate = "first_call"
    alltoall_size: int | None = None
    calibration: Any = None  # cpcompose.attention.cost.Calibration (not imported here: planning imports attention)
    topology: Any = None  # cpcompose.attention.cost.Topology

    def replace(self, **changes: Any) -> "CPOptions":
        """A copy with `changes` (TypeError names an unknown option, as a function call would)."""
        return dataclasses.replace(self, **changes) if changes else self

    def error(self, world: int) -> str | None:
        """Why these options cannot run on a CP group of `world` ranks, or None."""
        if self.strategy not in CHOICES:
            return f"strategy={self.strategy!r} is unknown; choose one of {CHOICES}"
        if self.meter is not None and not isinstance(self.meter, CommMeter):
            return f"meter must be a cpcompose.CommMeter, got {type(self.meter).__name__}"
        if self.validate not in VALIDATE_MODES:
            return f"validate={self.validate!r} is unknown; choose one of {VALIDATE_MODES}"
        return self._alltoall_size_error(world) or self.auto_error() or layout_error(self.layout, world)

    def auto_error(self) -> str | None:
        """What is wrong with the machine model `auto` would use (or its presence without `auto`), or None."""
        if self.calibration is None and self.topology is None:
            return None
        from cpcompose.attention.cost import Calibration, Topology  # planning imports attention: not at module level

        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            return f"calibration must be a cpcompose.attention.cost.Calibration, got {type(self.calibration).__name__}"
        if self.topology is not None and not isinstance(self.topology, Topology):
            return f"topology must be a cpcompose.attention.cost.Topology, got {type(self.topology).__name__}"
        if (self.calibration is not None or self.topology is not None) and self.strategy != AUTO:
            return (f"calibration and topology are only used by strategy='auto' (got strategy={self.strategy!r}): "
                    "drop them or set strategy='auto'")
        return None

    def _alltoall_size_error(self, world: int) -> str | None:
        a = self.alltoall_size
        if self.strategy != "alltoall_ring":
            if a is None:
                return None
            also = " ('auto' chooses it)" if self.strategy == AUTO else ""
            return (
                f"alltoall_size={a!r} is only used by strategy='alltoall_ring' (got strategy={self.strategy!r}{also}): "
                "drop alltoall_size or set strategy='alltoall_ring'"
            )
        if a is None:
            return (
                f"strategy='alltoall_ring' needs alltoall_size (ranks per all-to-all block), a divisor of the "
                f"{world} CP ranks"
            )
        if isinstance(a, bool) or not isinstance(a, int) or a < 1 or world % a:
            return f"alltoall_size={a!r} must be a positive int that divides the {world} CP ranks"
        return None
