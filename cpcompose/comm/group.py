"""The process group of a 1-D CP mesh, with this rank's place in it and what bounds its waits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpcompose import _compat
from cpcompose.comm.rehearsal import REHEARSAL_TIMEOUT, rehearsing

__all__ = ["CPGroup"]


@dataclass(frozen=True)
class CPGroup:
    """The process group of a 1-D CP mesh, with this rank's place in it."""

    group: dist.ProcessGroup
    rank: int
    world: int
    timeout: timedelta | None = None
    """Bound on point-to-point waits; None: the group's configured timeout, read when a RingComm is made."""

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> "CPGroup":
        """Raises ValueError unless `mesh` is 1-D (pass `mesh["cp"]` for a larger one)."""
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh must be 1-D (the CP dimension), got dims {mesh.mesh_dim_names}; "
                "pass mesh['cp']"
            )
        return cls(mesh.get_group(), mesh.get_local_rank(), mesh.size())

    def wait_timeout(self) -> timedelta:
        """What bounds a wait on this group: `timeout`, else the group's configured one (`set_timeout`), or in a
        rehearsal (`rehearsal_mode`) a fixed one."""
        if self.timeout is not None:
            return self.timeout
        if rehearsing():  # torch's fake group has no backend options to read the timeout from
            return REHEARSAL_TIMEOUT
        return _compat.group_timeout(self.group)
