"""`CPOptions`: how CP attention is computed, one object from the config to the kernel call.

The trainer builds one from its config, `parallelize` hands it to `ContextParallel`,
the style hands it to the SDPA route, and the route hands it to `cp_attention`:
nobody re-threads its fields by hand, so a new option is one field here. It is
checked where it is used, through the cross-rank agreement, so a bad value on one
rank raises on every rank instead of leaving the others waiting in a collective.

Every rule about the options lives here, once. A front end that spells them its own
way (the trainer's `parallelism.cp_*` keys, torchtitan's `cpcompose.*`) builds a
`CPOptions` and asks `problem(world, names=...)`: the same rule, reported under the
front end's own key names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Literal

from cpcompose.attention.cost.calibration import Calibration, Topology
from cpcompose.attention.strategies.registry import STRATEGIES, STRATEGY_NAMES
from cpcompose.comm import CommMeter
from cpcompose.layouts import LayoutSpec, layout_error

__all__ = ["AUTO", "CHOICES", "VALIDATE_MODES", "CPOptions", "OptionProblem", "StrategyChoice", "Validate"]

AUTO = "auto"  # the cost model picks one of the registered strategies per call (`cpcompose.attention.call.auto`)
CHOICES: tuple[str, ...] = (*STRATEGY_NAMES, AUTO)
StrategyChoice = Literal[CHOICES]  # type: ignore[valid-type]  # the choices, for configs that read Literal types
Validate = Literal["first_call", "every_call"]
VALIDATE_MODES: tuple[str, ...] = ("first_call", "every_call")


@dataclass(frozen=True)
class CPOptions:
    """The CP attention options shared by every entry point.

    Attributes:
        strategy: a registered strategy (`registry.STRATEGIES`): "ring" (K/V point-to-point), "allgather" (gather K/V),
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
            `cpcompose.agreement`). Must be the same on every rank.
        alltoall_size: "alltoall_ring" only (and required there): ranks per all-to-all
            block, a divisor of the CP size P; the ring runs over the P / alltoall_size
            blocks. Consecutive ranks form a block, so under torchrun a block that fits
            in a node keeps the all-to-all on the node's fast links. alltoall_size=P is
            Ulysses, 1 is the ring.
        calibration: "auto" only: the machine constants of the cost model (a
            `cpcompose.attention.cost.Calibration`, e.g. loaded from the JSON of
            `python -m cpcompose.attention.cost.calibrate`); None = the shipped defaults for
            the device type. Its fingerprint joins the agreement: every rank must use the same.
        topology: "auto" only: which CP ranks share a node (`cpcompose.attention.cost.Topology`);
            None = LOCAL_WORLD_SIZE ranks per node when torchrun sets it, else one node.
        head_chunks: "alltoall" only: run the attention over this many chunks of heads one after another (UPipe,
            `strategies/alltoall_chunked.py`), so the all-to-all buffers and the full-sequence working set hold one
            chunk's heads; 1 (the default) is plain Ulysses. Each call checks that it divides the K/V heads and
            leaves every rank a query head of each chunk (`head_chunks_error`).
        ring_tiles: "ring" and "alltoall_ring" (and the ring "auto" picks): the backward makes and sends each
            round's float32 dK/dV home in this many pieces of its key rows, so those buffers are a piece's, not a
            shard's (more, smaller messages); 1 (the default): one per round.
        verify: run the exactness probe (`cpcompose.verify`) where a front end offers it: the
            Hugging Face integration on a model's first forward in a CP region, the trainer
            at start. False skips it (it costs two forwards at a short length, once).
    """

    strategy: str = "ring"
    layout: LayoutSpec = None
    window_size: int | tuple[int, int] | None = None
    backend: str | None = None
    meter: CommMeter | None = None
    validate: Validate = "first_call"
    alltoall_size: int | None = None
    calibration: Calibration | None = None
    topology: Topology | None = None
    verify: bool = True
    head_chunks: int = 1
    ring_tiles: int = 1

    def replace(self, **changes: Any) -> "CPOptions":
        """A copy with `changes` (TypeError names an unknown option, as a function call would)."""
        return dataclasses.replace(self, **changes) if changes else self

    def error(self, world: int) -> str | None:
        """Why these options cannot run on a CP group of `world` ranks, in the library's words, or None."""
        problem = self.problem(world)
        return None if problem is None else problem.text

    def problem(self, world: int | None, *, names: Mapping[str, str] | None = None) -> "OptionProblem | None":
        """The first rule these options break on a CP group of `world` ranks, or None.

        Args:
            world: the CP group size; None checks everything that does not depend on it
                (a config read before the group exists).
            names: the front end's key for each field it sets (e.g. `{"strategy":
                "parallelism.cp_strategy"}`); messages name fields by these keys.
        """
        def key(name: str) -> str:
            return (names or {}).get(name, name)

        def broken(name: str, text: str) -> OptionProblem:
            return OptionProblem(name, key(name), text)

        if self.strategy not in CHOICES:
            return broken("strategy", f"{key('strategy')}={self.strategy!r} is unknown; choose one of {CHOICES}")
        if self.meter is not None and not isinstance(self.meter, CommMeter):
            return broken("meter", f"{key('meter')} must be a cpcompose.CommMeter, got {type(self.meter).__name__}")
        if not isinstance(self.verify, bool):
            return broken("verify", f"{key('verify')} must be True or False, got {self.verify!r}")
        if self.validate not in VALIDATE_MODES:
            return broken("validate", f"{key('validate')}={self.validate!r} is unknown; choose one of {VALIDATE_MODES}")
        size = self._alltoall_size_error(world, key)
        if size:
            return broken("alltoall_size", size)
        chunks = self._head_chunks_error(key)
        if chunks:
            return broken("head_chunks", chunks)
        tiles = self._ring_tiles_error(key)
        if tiles:
            return broken("ring_tiles", tiles)
        auto = self._auto_error(key)
        if auto:
            return broken(auto[0], auto[1])
        layout = layout_error(self.layout, world if world is not None else getattr(self.layout, "world", 1))
        if layout:
            return broken("layout", layout.replace("layout=", f"{key('layout')}=", 1))
        return None

    def auto_error(self) -> str | None:
        """What is wrong with the machine model `auto` would use (or its presence without `auto`), or None."""
        found = self._auto_error(lambda name: name)
        return None if found is None else found[1]

    def _auto_error(self, key: Any) -> tuple[str, str] | None:
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            return "calibration", (f"{key('calibration')} must be a cpcompose.attention.cost.Calibration, "
                                   f"got {type(self.calibration).__name__}")
        if self.topology is not None and not isinstance(self.topology, Topology):
            return "topology", (f"{key('topology')} must be a cpcompose.attention.cost.Topology, "
                                f"got {type(self.topology).__name__}")
        if (self.calibration is not None or self.topology is not None) and self.strategy != AUTO:
            which = "calibration" if self.calibration is not None else "topology"
            return which, (f"{key(which)} is only used by {key('strategy')}='auto' (got {key('strategy')}="
                           f"{self.strategy!r}): drop it or set {key('strategy')}='auto'")
        return None

    def _head_chunks_error(self, key: Any) -> str | None:
        """The rules of `head_chunks` that need no head counts (those are checked per call)."""
        n, strategy, chunks = self.head_chunks, key("strategy"), key("head_chunks")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"{chunks}={n!r} must be a positive int (1: all heads at once)"
        if n == 1 or self.strategy == "alltoall":
            return None
        why = {
            AUTO: "'auto' chooses by predicted time and does not weigh memory",
            "alltoall_ring": "not supported yet (its ring would have to run once per chunk, the head-sharded "
                             "ring state saved per chunk)",
        }.get(self.strategy, "it trades no heads")
        return (f"{chunks}={n!r} chunks the heads of {strategy}='alltoall' only; {strategy}={self.strategy!r}: "
                f"{why}. Set {strategy}='alltoall' or {chunks}=1")

    def _ring_tiles_error(self, key: Any) -> str | None:
        n, strategy, tiles = self.ring_tiles, key("strategy"), key("ring_tiles")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return f"{tiles}={n!r} must be a positive int (1: each round's dK/dV in one piece)"
        if n == 1 or self.strategy in ("ring", "alltoall_ring", AUTO):
            return None
        return (f"{tiles}={n!r} pieces the ring's backward, and {strategy}={self.strategy!r} runs no ring: set "
                f"{strategy}='ring' (or 'alltoall_ring', 'auto') or {tiles}=1")

    def _alltoall_size_error(self, world: int | None, key: Any) -> str | None:
        a, strategy, size = self.alltoall_size, key("strategy"), key("alltoall_size")
        takes = [name for name, s in STRATEGIES.items() if s.takes_alltoall_size]
        if self.strategy not in takes:
            if a is None:
                return None
            also = " ('auto' chooses it)" if self.strategy == AUTO else ""
            return (
                f"{size}={a!r} is only used by {strategy}={takes[0]!r} (got {strategy}={self.strategy!r}{also}): "
                f"drop {size} or set {strategy}={takes[0]!r}"
            )
        ranks = "the CP degree" if world is None else f"the {world} CP ranks"
        if a is None:
            return f"{strategy}={self.strategy!r} needs {size} (ranks per all-to-all block), a divisor of {ranks}"
        if isinstance(a, bool) or not isinstance(a, int) or a < 1 or (world is not None and world % a):
            return f"{size}={a!r} must be a positive int that divides {ranks}"
        return None


@dataclass(frozen=True)
class OptionProblem:
    """A broken option rule: the field at fault, the front end's key for it, and the message."""

    field: str
    key: str
    text: str

    def keyed(self) -> str:
        """The message as `key: ...`, the way configs report errors (the value follows the key once)."""
        for lead in (f"{self.key}=", f"{self.key} "):
            if self.text.startswith(lead):
                return f"{self.key}: {self.text[len(lead):]}"
        return f"{self.key}: {self.text}"
