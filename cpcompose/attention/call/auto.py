"""`strategy="auto"`: each call's strategy chosen by the cost model, the same on every rank.

The choice is a pure function of what the cross-rank agreement compares (shapes,
dtype, mask, window, the layout's identity) plus the calibration's fingerprint and
the topology, which join the agreed signature: ranks that pass the agreement have
computed the same choice, with no communication of their own. It is made once per
call signature (cached), so layers with different masks (global and sliding-window)
and batches with different documents may each get their own strategy. The first
call of each signature logs one line on CP rank 0 (logger "cpcompose.auto") with
every candidate's predicted time, and the choice is counted in the call's
`CommMeter` (the trainer's TensorBoard shows it). See `cpcompose.attention.cost`.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.call.choose import Choice, choose_strategy
from cpcompose.attention.cost.calibration import Calibration, Topology, default_calibration
from cpcompose.attention.cost.call import AttentionCall
from cpcompose.attention.call.options import AUTO, CPOptions
from cpcompose.layouts import Layout

log = logging.getLogger("cpcompose.auto")


def machine_model(options: CPOptions, device: torch.device) -> tuple[Calibration, Topology]:
    """The constants and topology `auto` uses: the options', else the device's defaults and LOCAL_WORLD_SIZE."""
    calibration = options.calibration or default_calibration(device.type)
    return calibration, options.topology or Topology.from_env()


def resolve(
    options: CPOptions, q: Tensor, k: Tensor, v: Tensor, *, layout: Layout, mask: MaskSpec, need_lse: bool,
    rank: int,
) -> tuple[CPOptions, Choice]:
    """The options with `strategy="auto"` replaced by the cost model's choice for this call."""
    calibration, topology = machine_model(options, q.device)
    call = AttentionCall.from_tensors(q, k, v, layout=layout, mask=mask, need_lse=need_lse)
    before = _choose.cache_info().misses
    choice = _choose(call, topology, calibration, layout.world)
    if rank == 0 and _choose.cache_info().misses != before:
        log.info("%s", choice.log_line())
    if options.meter is not None:
        options.meter.note_choice(choice.costs_label, choice.predicted_s)
    return options.replace(strategy=choice.strategy, alltoall_size=choice.alltoall_size), choice


@functools.lru_cache(maxsize=1024)
def _choose(call: AttentionCall, topology: Topology, calibration: Calibration, world: int) -> Choice:
    """`choose_strategy`, once per signature (10-60 ms of planning, so never per call)."""
    return choose_strategy(call, topology, calibration, world)


__all__ = ["AUTO", "machine_model", "resolve"]
