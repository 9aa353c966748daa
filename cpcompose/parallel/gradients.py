"""Summing parameter gradients over dp x cp, in one order every rank shares.

Each rank's gradient covers only its own tokens, so the gradients FSDP does not reduce
must be summed over the dp x cp group (`loss.py` says why a sum). The sum is a few flat
all-reduces, one per dtype, and every rank must post the same ones, of the same sizes,
in the same order, or gloo pairs a float64 buffer with a float32 one (silently wrong
sums) or aborts. So nothing here depends on a set, a hash or a rank's own data:

* parameters are walked in `module.parameters()` order (registration order: the same
  model on every rank gives the same order; a tiny agreement checks it did);
* a gradient present on some ranks only (an MoE expert that no token of this rank
  reached) is a zero there; one missing on every rank stays None (nothing to sum). Which
  is which is agreed in one tiny all-reduce of the presence flags;
* dtypes are bucketed in the order they first appear in that walk, never by iterating a set;
* each bucket is summed in its accumulation dtype (float32 for bfloat16 and float16, `precision.py`) and rounded
  once: summed in bfloat16, every partial sum would round (measured: a bf16 model's gradients at P = 4 off by
  one bf16 rounding per rank beyond one process's).
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cpcompose.agreement import agree_across_ranks
from cpcompose.comm import CPGroup, all_reduce
from cpcompose.precision import accumulation_dtype

__all__ = ["allreduce_gradients"]


def allreduce_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Sum parameter gradients over `mesh` (dp x cp, 1-D) for parameters FSDP does not reduce.

    One flat all-reduce per dtype, in the order the dtypes first appear among the parameters;
    DTensor (e.g. TP) gradients reduce their local shards. A gradient that is None on some
    ranks only is summed as zeros there (and is a tensor afterwards on every rank).

    Raises:
        ValueError: on every rank, before any gradient moves, if the ranks' modules do not
            have the same parameters (count, local shapes and dtypes, in order).
    """
    cp = CPGroup.from_mesh(mesh)
    params = list(module.parameters())
    shards = [_local(p) for p in params]
    device = shards[0].device if shards else torch.device("cpu")
    layout = repr([(tuple(s.shape), str(s.dtype)) for s in shards]).encode()
    agree_across_ranks(cp, None, [("parameters", len(params)), ("parameter shapes and dtypes", zlib.crc32(layout))],
                       what="allreduce_gradients (every rank must pass the same model)", device=device)
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    all_reduce(present, cp.group, op="max")
    summed = [p for p, somewhere in zip(params, present.tolist()) if somewhere]
    for p in summed:
        if p.grad is None:  # no token of this rank reached it: it adds nothing
            p.grad = torch.zeros_like(p)
    grads = [_local(p.grad) for p in summed]
    for dtype in dict.fromkeys(g.dtype for g in grads):  # first-appearance order, the same on every rank
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same]).to(accumulation_dtype(dtype))
        all_reduce(flat, cp.group, op="sum")
        for g, reduced in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(reduced.view_as(g))


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
