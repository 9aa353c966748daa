"""The communication cpcompose does, in one place, with a byte meter.

Every byte cpcompose moves goes through this package, so an optional `CommMeter`
can count it without CommDebugMode (which cannot see a backward in torch 2.13)
and without patching torch, every wait is bounded, and the order of the
collectives is one all ranks share. Counts are what *this rank sends* under the
textbook algorithm of each collective: P-1 shards for an all-gather, (P-1)/P of
the input for a reduce-scatter, the off-rank splits of an all-to-all, and the
exact tensors of a point-to-point send.

CUDA tensors on a gloo group (several ranks sharing one GPU, where NCCL refuses
to run) travel through host memory: `staging` decides it once per group, and
each helper copies to host, communicates, and copies back. CPU tensors, and CUDA
tensors on NCCL, never take that path (no copies, no extra calls).

Rooms: `meter` (the byte meter), `staging` (the host path), `group` (`CPGroup`),
`ring` (point-to-point), `collectives` (posted collectives over a CP group),
`rehearsal` (the switch of a step on fake tensors: `rehearsal_mode`), `row_fetch`
(rows fetched from their owners, differentiably: the conv halo's and sparse
attention's one primitive), `token_dispatch` (each routed row to its expert's rank
and back, differentiably: expert parallelism's dispatch and combine) and `blocking`
(the few blocking collectives on any process group: the trainer's, the
checkpoint's, the agreement's messages).
No other module calls a torch.distributed collective (tests/test_comm_boundary.py).
"""

from cpcompose.comm.blocking import (
    ReduceOp,
    all_gather_into,
    all_gather_objects,
    all_gather_tensors,
    all_reduce,
    all_to_all_into,
    barrier,
    broadcast,
    broadcast_object,
)
from cpcompose.comm.collectives import (
    PendingCollective,
    all_gather,
    all_to_all_pieces,
    start_all_gather,
    start_all_to_all_pieces,
    start_all_to_all_rows,
    start_reduce_scatter,
)
from cpcompose.comm.group import CPGroup
from cpcompose.comm.meter import CommMeter
from cpcompose.comm.rehearsal import rehearsal_mode, rehearsing
from cpcompose.comm.ring import PendingRecv, RingComm
from cpcompose.comm.row_fetch import (
    FetchPlan,
    PostedFetch,
    fetch_positions,
    fetch_rows,
    plan_by_peer,
    plan_fetch,
    post_fetch,
)
from cpcompose.comm.staging import backend_for
from cpcompose.comm.token_dispatch import (
    Dispatched,
    combine_error,
    combine_from_experts,
    dispatch_error,
    dispatch_to_experts,
)

__all__ = [
    "CPGroup", "CommMeter", "Dispatched", "FetchPlan", "PendingCollective", "PendingRecv", "PostedFetch", "ReduceOp",
    "RingComm", "all_gather", "all_gather_into", "all_gather_objects", "all_gather_tensors", "all_reduce",
    "all_to_all_into", "all_to_all_pieces", "backend_for", "barrier", "broadcast", "broadcast_object",
    "combine_error", "combine_from_experts", "dispatch_error", "dispatch_to_experts", "fetch_positions", "fetch_rows",
    "plan_by_peer", "plan_fetch", "post_fetch", "rehearsal_mode", "rehearsing", "start_all_gather",
    "start_all_to_all_pieces", "start_all_to_all_rows", "start_reduce_scatter",
]
