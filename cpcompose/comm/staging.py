"""CUDA tensors on a gloo group travel through host memory: the decision, made once per group, and the copy.

gloo's point-to-point reads the tensor's raw pointer as host memory, and its CUDA
collectives vary between versions, so cpcompose stages CUDA tensors itself: one
explicit path, the same for every operation. Every helper asks `host_staging`
through this module (`staging.host_staging(...)`), so a test can force the path
for CPU tensors by replacing that one function.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["backend_for", "host_staging", "runs_on_gloo", "to_host"]


def backend_for(backend: str, device_type: str) -> str:
    """The backend a process group with `dist.get_backend` name `backend` uses for `device_type`.

    A plain name ("gloo", "nccl") serves every device; a per-device spec looks like
    "cpu:gloo,cuda:nccl" and names each device's backend ("" when it names none).
    """
    if ":" not in backend:
        return backend
    pairs = (item.split(":", 1) for item in backend.split(","))
    return {dev.strip(): name.strip() for dev, name in pairs}.get(device_type, "")


@functools.cache
def runs_on_gloo(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether `group` hands `device_type` tensors to gloo (decided once per group and device, cached)."""
    return backend_for(str(dist.get_backend(group)), device_type) == "gloo"


def host_staging(t: Tensor, group: dist.ProcessGroup) -> torch.device | None:
    """The device to copy results back to when `t` must travel through host memory, else None.

    CPU tensors return at the first test.
    """
    if t.device.type != "cuda" or not runs_on_gloo(group, "cuda"):
        return None
    return t.device


def to_host(t: Tensor) -> Tensor:
    """A host copy of `t` (a synchronous copy: the data is complete before gloo reads it)."""
    return t.to("cpu", copy=True)
