"""The one mapping from the config's `[parallelism]` keys to the attention library's `CPOptions`.

The trainer, the exactness probe and the memory plan all take their CP options from here, so a key means the
same to each; option errors name the config's keys (`CP_OPTION_KEYS`), not the library's field names.
"""

from __future__ import annotations

from pathlib import Path

from cpcompose.attention.call.options import CPOptions
from cpcompose.attention.cost.calibration import Calibration, Topology
from cpcompose.comm import CommMeter
from cpcompose.config.sections import ConfigError, Parallelism

__all__ = ["CP_OPTION_KEYS", "cp_options", "cp_options_error"]

CP_OPTION_KEYS = {
    "strategy": "parallelism.cp_strategy", "layout": "parallelism.cp_layout",
    "alltoall_size": "parallelism.cp_alltoall_size", "validate": "parallelism.cp_validate",
    "calibration": "parallelism.cp_calibration", "verify": "parallelism.cp_verify",
    "head_chunks": "parallelism.cp_head_chunks", "ring_tiles": "parallelism.cp_ring_tiles",
}
"""The key of each `CPOptions` field the config sets: option errors name them."""


def cp_options(p: Parallelism, *, meter: CommMeter | None = None) -> CPOptions:
    """The CP attention options `p` describes: one object, from here to every attention call.

    Reads `parallelism.cp_calibration`'s JSON when set (the resolution step has checked that it loads).
    """
    calibration = None if p.cp_calibration is None else Calibration.load(p.cp_calibration)
    return CPOptions(strategy=p.cp_strategy, layout=p.cp_layout, meter=meter, alltoall_size=p.cp_alltoall_size,
                     validate=p.cp_validate, calibration=calibration, verify=p.cp_verify, topology=_cp_topology(p),
                     head_chunks=p.cp_head_chunks, ring_tiles=p.cp_ring_tiles)


def _cp_topology(p: Parallelism) -> Topology | None:
    """Which CP ranks share a node, for `auto`'s cost model: a node's `LOCAL_WORLD_SIZE` ranks (torchrun) hold
    LOCAL_WORLD_SIZE / tp CP ranks, tp being innermost in the mesh (`distributed.nodes`); None when unset, and for
    any other strategy (which takes no topology)."""
    local = Topology.from_env().ranks_per_node
    return None if local is None or p.cp_strategy != "auto" else Topology(max(1, local // p.tp))


def cp_options_error(p: Parallelism) -> ConfigError | None:
    """What the attention library refuses in `p` (a strategy, layout or block size, a calibration file that does not
    load), keyed by the config's names; None when the options hold."""
    if p.cp_calibration is not None and not Path(p.cp_calibration).is_file():
        return ConfigError(f"parallelism.cp_calibration: {p.cp_calibration!r} is not a file; write one with "
                           "python -m cpcompose.attention.cost.calibrate")
    try:
        options = cp_options(p)
    except (ValueError, OSError) as e:  # the calibration file cannot be read as one
        return ConfigError(f"parallelism.cp_calibration: {e}")
    problem = options.problem(p.cp, names=CP_OPTION_KEYS)  # the options' own rules, under our keys
    return None if problem is None else ConfigError(problem.keyed())
