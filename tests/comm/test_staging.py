"""The host staging of CUDA tensors on gloo groups, checked on the CPU.

On a single GPU shared by P ranks, the group is gloo and `cpcompose.comm` copies
CUDA tensors to host memory, communicates, and copies back (p2p receives on
`PendingRecv.wait()`). Without a GPU that path is exercised by forcing it for CPU
tensors: every helper then really copies out and back, and each strategy's output,
LSE and gradients must equal the unstaged run bit for bit, with the same byte
counts. The `gpu` tests run it for real (tests/support/rank_pool.py picks gloo on one GPU).
"""

from __future__ import annotations

import pytest
import torch

from cpcompose.comm import staging
from tests.support.attention_cases import Case, run_cp

NAMES = ("out", "lse", "dq", "dk", "dv", "forward_bytes", "total_bytes")


@pytest.mark.parametrize(
    "backend,device,expected",
    [
        ("gloo", "cuda", "gloo"), ("nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("cpu:gloo,cuda:gloo", "cuda", "gloo"), ("cpu:gloo", "cuda", ""),
    ],
)
def test_backend_for_device(backend: str, device: str, expected: str) -> None:
    assert staging.backend_for(backend, device) == expected


def test_cpu_tensors_never_stage(pools) -> None:
    """The decision is None for CPU tensors on a gloo group: the CPU path makes no copies."""
    assert pools.get(2).run(_staging_of_cpu_tensor) == [None, None]


def _staging_of_cpu_tensor(mesh) -> torch.device | None:
    return staging.host_staging(torch.zeros(1), mesh.get_group())


def run_staged(mesh, case: Case) -> dict:
    """`run_cp` with every communication forced through the host-staging path."""
    original = staging.host_staging
    staging.host_staging = lambda t, group: t.device  # stage everything, back to where it was
    try:
        return run_cp(mesh, case)
    finally:
        staging.host_staging = original


@pytest.mark.parametrize(
    "strategy,world,alltoall_size",
    [(s, w, None) for s in ("ring", "allgather", "alltoall") for w in (2, 3)] + [("alltoall_ring", 4, 2)],
)
def test_staged_path_is_bit_identical(pools, strategy: str, world: int, alltoall_size: int | None) -> None:
    """Point-to-point (both ring streams), all-gather, reduce-scatter, all-to-all and the agreement, staged."""
    case = Case(strategy, "zigzag", True, 8, 2, world, seq=24 * world, alltoall_size=alltoall_size)
    pool = pools.get(world)
    plain, staged = pool.run(run_cp, case), pool.run(run_staged, case)
    for rank, (a, b) in enumerate(zip(plain, staged)):
        for name in NAMES:
            if isinstance(a[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), f"rank {rank} {name}"
            else:
                assert a[name] == b[name], f"rank {rank} {name}"
