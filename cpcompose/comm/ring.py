"""Point-to-point exchanges between the ranks of a CP group, posted at once, each wait bounded."""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from cpcompose.comm import staging
from cpcompose.comm.group import CPGroup
from cpcompose.comm.meter import CommMeter, nbytes

__all__ = ["PendingRecv", "RingComm"]


class PendingRecv:
    """Tensors being received; `wait()` returns them once the exchange is done.

    Gloo's point-to-point works wait, by default, for the timeout the group was
    *created* with (typically the generous init timeout), not the one set later with
    `set_timeout`; so a stalled peer would hold a ring job ~10 minutes while
    collectives give up after `comm.timeout_s`. An explicit `timeout` bounds the wait.
    """

    def __init__(
        self, works: list[dist.Work], tensors: list[Tensor], timeout: timedelta | None = None, *,
        device: torch.device | None = None, keep: Sequence[Tensor] = (),
    ) -> None:
        """`device`: where host-staged `tensors` go once received (None: they are already there).

        `keep` holds host copies being sent until the exchange is done.
        """
        self._works, self._tensors, self._timeout = works, tensors, timeout
        self._device, self._keep = device, list(keep)

    def wait(self) -> list[Tensor]:
        """Raises RuntimeError (from the backend) when a peer does not answer within the timeout."""
        for work in self._works:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(self._timeout)
        self._keep.clear()
        if self._device is not None:
            return [t.to(self._device, copy=True) for t in self._tensors]
        return self._tensors


class RingComm:
    """Point-to-point exchanges between the ranks of a CP group, posted at once.

    `exchange_with` returns immediately, so the caller computes on the current
    block while the next one travels. Distinct `tag`s keep two streams that are in
    flight together (K/V and their gradients) apart on backends that match by tag.
    """

    def __init__(self, cp: CPGroup, meter: CommMeter | None = None, *, timeout: timedelta | None = None) -> None:
        """`timeout` bounds every receive; None takes the group's configured timeout (`set_timeout`)."""
        self.cp, self.meter = cp, meter
        self.timeout = timeout if timeout is not None else cp.wait_timeout()

    def exchange_with(
        self, send: Sequence[Tensor], *, dst: int, recv_like: Sequence[Tensor], src: int, tag: int = 0
    ) -> PendingRecv:
        """Send `send` (contiguous) to group rank `dst`; receive tensors shaped like `recv_like` from `src`.

        Empty tensors are not sent: the peer computes the same sizes and posts no receive.
        CUDA tensors on a gloo group are sent from host copies and received into host
        buffers, copied to the device by `PendingRecv.wait()`.
        """
        group = self.cp.group
        tensors = [*send, *recv_like]
        device = staging.host_staging(tensors[0], group) if tensors else None
        if device is None:
            wire, recv = list(send), [torch.empty_like(t) for t in recv_like]
        else:
            wire, recv = [staging.to_host(t) for t in send], [torch.empty_like(t, device="cpu") for t in recv_like]
        ops = [dist.P2POp(dist.isend, t, group=group, group_peer=dst, tag=tag) for t in wire if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=src, tag=tag) for t in recv if t.numel()]
        works = dist.batch_isend_irecv(ops) if ops else []
        if self.meter is not None:
            self.meter.add("p2p", nbytes([t for t in send if t.numel()]))
        if device is None:
            return PendingRecv(works, recv, self.timeout)
        return PendingRecv(works, recv, self.timeout, device=device, keep=wire)
