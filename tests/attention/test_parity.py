"""Every strategy x layout x mask x head shape x group size x dtype, against one process.

Tolerance, and why: a CP result cannot be more exact than the kernel it is built
from, so its error against a float64 explicit-softmax reference is compared with
the error of single-process PyTorch SDPA in the same dtype against that same
reference. We require, per tensor (output, LSE, dQ, dK, dV):

* RMS error <= 2x the single-process RMS error. RMS over all elements is stable
  (measured ratios are 0.9-1.2 for fp32 and bf16), and any real bug (a wrong mask,
  a mis-merged block, a lost gradient hop) moves it by orders of magnitude.
* max error <= 4x the single-process max error. The largest error is a single
  rounding event, noisy to within ~2.3x here; 4x still flags any localized bug.

A window is given to the single-process SDPA as an additive mask, and Dv != Dqk
as zero-padded head dims. Softcap, which no PyTorch kernel has, is measured
against an explicit softmax in the same dtype through autograd (cpcompose computes
capped blocks the same explicit way in float32, so the ratio is ~1).

For bf16 the same rule holds against bf16 SDPA: CP merges and accumulates in
float32, so splitting the sequence adds only the rounding of each partial block
output to bf16 (measured RMS ratio <= 1.12).

On CUDA (tests marked `gpu`) the rule is the same, against single-process SDPA
on the GPU pinned to the kernel cpcompose uses there (flash for bf16, memory-
efficient for fp32; `tests/support/device_baseline.py`), computed by a worker; the float64
reference stays in the parent, on the CPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.attention_cases import Case, assert_matches_single_process, run_cp

HEADS = [(4, 4), (8, 2), (6, 1), (5, 5)]  # MHA, GQA 4:1, MQA, and 5 heads no P divides
MATRIX = [
    Case(strategy, layout, causal, hq, hkv, world, dtype=dtype, seq=24 * world)
    for world, dtype, strategy, layout, causal, (hq, hkv) in itertools.product(
        (2, 3, 4), (torch.float32, torch.bfloat16), ("ring", "allgather", "alltoall"),
        ("zigzag", "contiguous"), (True, False), HEADS,
    )
]


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_single_process(pools, case: Case) -> None:
    assert_matches_single_process(case, pools.get(case.world).run(run_cp, case))


# Masks and shapes beyond plain SDPA. Chunks are 6 (zigzag, P=4) to 24 (contiguous,
# P=2) positions, so (5, 3) stays near the chunk edges, (17, 30) reaches across
# several chunks on both sides, and a right-only bound mixes unbounded and bounded.
VARIANTS = [
    dict(causal=False, window=(5, 3), heads=4, kv_heads=2),  # bidirectional local attention, GQA
    dict(causal=False, window=(17, 30), heads=4, kv_heads=4),
    dict(causal=False, window=(-1, 2), heads=6, kv_heads=2),  # everything before, 2 after
    dict(causal=True, window=(9, 0), heads=4, kv_heads=2),  # the pair form of a causal window
    dict(causal=True, heads=6, kv_heads=2, head_dim=24, v_dim=16),  # MLA-like: Dv < Dqk, with GQA
    dict(causal=False, window=(7, 7), heads=4, kv_heads=4, head_dim=16, v_dim=24),  # Dv > Dqk
    dict(causal=True, softcap=1.5, heads=4, kv_heads=2),  # logit cap (Gemma 2), causal
    dict(causal=False, window=(6, 10), softcap=2.0, heads=4, kv_heads=1, head_dim=24, v_dim=16),  # all at once
]
MASK_MATRIX = [
    Case(strategy, layout, seq=24 * world, world=world, **variant)  # type: ignore[arg-type]
    for world, strategy, layout, variant in itertools.product(
        (2, 4), ("ring", "allgather", "alltoall"), ("zigzag", "contiguous"), VARIANTS
    )
]


@pytest.mark.parametrize("case", MASK_MATRIX, ids=str)
def test_windows_mla_softcap_match_single_process(pools, case: Case) -> None:
    """Two-sided windows, Dv != Dqk and softcap: exact under every strategy and layout (fp32)."""
    assert_matches_single_process(case, pools.get(case.world).run(run_cp, case))


# 2-D ("alltoall_ring"): P=4 as 2 x 2 through the matrix above (bf16 under zigzag only);
# the degenerate factorisations (a = P: Ulysses, a = 1: the ring, through the 2-D code)
# at P=2 and P=4, with even (8:2) and uneven (5 heads) head splits.
TWOD_MATRIX = [
    Case("alltoall_ring", layout, causal, hq, hkv, 4, dtype=dtype, seq=96, alltoall_size=2)
    for (dtype, layout), causal, (hq, hkv) in itertools.product(
        [(torch.float32, "zigzag"), (torch.float32, "contiguous"), (torch.bfloat16, "zigzag")], (True, False), HEADS
    )
] + [
    Case("alltoall_ring", layout, causal, hq, hkv, world, seq=24 * world, alltoall_size=a)
    for (world, a, (hq, hkv)), layout, causal in itertools.product(
        [(2, 1, (8, 2)), (2, 1, (5, 5)), (2, 2, (8, 2)), (2, 2, (5, 5)), (4, 1, (8, 2)), (4, 4, (5, 5))],
        ("zigzag", "contiguous"), (True, False),
    )
] + [  # fewer heads than the all-to-all block: places without heads
    Case("alltoall_ring", "zigzag", True, 1, 1, 4, seq=96, alltoall_size=2),
    Case("alltoall_ring", "zigzag", False, 3, 1, 4, seq=96, alltoall_size=4),
    Case("alltoall_ring", "contiguous", True, 9, 3, 4, seq=96, alltoall_size=2),  # 5 + 4 heads over 3 K/V heads
]


@pytest.mark.parametrize("case", TWOD_MATRIX, ids=str)
def test_twod_matches_single_process(pools, case: Case) -> None:
    assert_matches_single_process(case, pools.get(case.world).run(run_cp, case))


TWOD_MASK_MATRIX = [
    Case("alltoall_ring", layout, seq=24 * world, world=world, alltoall_size=a, **variant)  # type: ignore[arg-type]
    for (world, a), layout, variant in itertools.product(((4, 2),), ("zigzag", "contiguous"), VARIANTS)
] + [
    Case("alltoall_ring", "zigzag", seq=48, world=2, alltoall_size=a, **variant)  # type: ignore[arg-type]
    for a, variant in itertools.product((1, 2), VARIANTS[:4])
]


@pytest.mark.parametrize("case", TWOD_MASK_MATRIX, ids=str)
def test_twod_windows_mla_softcap_match_single_process(pools, case: Case) -> None:
    """Two-sided windows (a halo on the ring dimension), Dv != Dqk and softcap under 2-D (fp32)."""
    assert_matches_single_process(case, pools.get(case.world).run(run_cp, case))


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_math_backend_matches(pools, strategy: str) -> None:
    """The portable math kernel gives the same CP result as the fused CPU kernel."""
    case = Case(strategy, "zigzag", True, 8, 2, 3, seq=72, backend="math")
    assert_matches_single_process(case, pools.get(3).run(run_cp, case))


def test_twod_math_backend_matches(pools) -> None:
    case = Case("alltoall_ring", "zigzag", True, 8, 2, 4, seq=96, backend="math", alltoall_size=2)
    assert_matches_single_process(case, pools.get(4).run(run_cp, case))


def test_longer_sequence_and_batch(pools) -> None:
    """A larger case, with many kernel tiles per block."""
    case = Case("ring", "zigzag", True, 8, 2, 2, batch=1, seq=1024, head_dim=32)
    assert_matches_single_process(case, pools.get(2).run(run_cp, case))


def test_wrong_layout_is_detected(pools) -> None:
    """Negative control: shards cut zigzag but attended as contiguous must fail the check."""
    case = Case("ring", "zigzag", True, 4, 4, 2, seq=48, attend_layout="contiguous")
    per_rank = pools.get(2).run(run_cp, case)
    with pytest.raises(AssertionError, match="RMS error"):
        assert_matches_single_process(case, per_rank)


# The same rule on CUDA: every strategy x layout x mask, MHA and GQA 4:1, P = 2 and 4
# (NCCL where there are P GPUs, else P processes sharing one through gloo), fp32 and bf16.
CUDA_MATRIX = [
    Case(strategy, layout, causal, hq, hkv, world, dtype=dtype, seq=24 * world, device="cuda")
    for world, dtype, strategy, layout, causal, (hq, hkv) in itertools.product(
        (2, 4), (torch.float32, torch.bfloat16), ("ring", "allgather", "alltoall"),
        ("zigzag", "contiguous"), (True, False), [(4, 4), (8, 2)],
    )
] + [
    Case("alltoall_ring", layout, causal, hq, hkv, 4, dtype=dtype, seq=96, device="cuda", alltoall_size=2)
    for dtype, layout, causal, (hq, hkv) in itertools.product(
        (torch.float32, torch.bfloat16), ("zigzag", "contiguous"), (True, False), [(4, 4), (8, 2)]
    )
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_MATRIX, ids=str)
def test_cuda_matches_single_process(pools, case: Case) -> None:
    assert_matches_single_process(case, pools.get(case.world, "cuda").run(run_cp, case))


# Window edges, MLA and softcap on the CUDA kernels: fp32 bands go to the efficient kernel
# with an additive bias, bf16 ones to flash-attn's native window (or the efficient kernel
# where the band has no flash-attn spelling), float64 to the explicit path.
CUDA_MASK_MATRIX = [
    Case(strategy, "zigzag", seq=24 * world, world=world, dtype=dtype, device="cuda", **variant)  # type: ignore[arg-type]
    for world, dtype, strategy, variant in itertools.product(
        (2, 4), (torch.float32, torch.bfloat16), ("ring", "allgather", "alltoall"), VARIANTS
    )
] + [Case(s, "zigzag", True, 4, 2, 2, dtype=torch.float64, seq=48, window=(9, 0), device="cuda")
     for s in ("ring", "allgather", "alltoall")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_MASK_MATRIX, ids=str)
def test_cuda_windows_mla_softcap_match_single_process(pools, case: Case) -> None:
    assert_matches_single_process(case, pools.get(case.world, "cuda").run(run_cp, case))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_efficient", "cuda_cudnn", "cuda_flash"])
def test_cuda_forced_backends_match(pools, backend: str) -> None:
    """Each aten CUDA kernel, forced, with windows (their band blocks go to the efficient kernel's bias)."""
    dtype = torch.float32 if backend == "cuda_efficient" else torch.bfloat16
    case = Case("ring", "zigzag", False, 4, 2, 2, dtype=dtype, seq=96, window=(17, 5), backend=backend,
                device="cuda")
    assert_matches_single_process(case, pools.get(2, "cuda").run(run_cp, case))


@pytest.mark.gpu
def test_cuda_longer_sequence(pools) -> None:
    """Many kernel tiles per block on the GPU kernels, bf16 (the flash kernel)."""
    case = Case("ring", "zigzag", True, 8, 2, 2, dtype=torch.bfloat16, batch=1, seq=1024, head_dim=64, device="cuda")
    assert_matches_single_process(case, pools.get(2, "cuda").run(run_cp, case))


def fused_routes(mesh) -> dict:
    """Where "cuda_fused" sends a small and a large plain block on this GPU."""
    from cpcompose.attention.local import kernels

    def route(heads: int, n: int, dim: int) -> str:
        q = torch.empty(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
        return kernels._route(kernels.select_backend(q), None, None, q, q, True)[0]

    return {"capability": torch.cuda.get_device_capability(), "small": route(8, 1024, 64),
            "large": route(32, 1024, 128)}


@pytest.mark.gpu
def test_cuda_large_blocks_run_on_cudnn_exactly(pools) -> None:
    """bf16 blocks of 32 heads x 1024 rows x 128 dims go to cuDNN on Hopper (`cudnn_is_faster`); still exact."""
    routes = pools.get(2, "cuda").run(fused_routes)[0]
    hopper = tuple(routes["capability"]) >= (9, 0)
    assert routes == {**routes, "small": "cuda_flash", "large": "cuda_cudnn" if hopper else "cuda_flash"}, routes
    case = Case("ring", "zigzag", True, 32, 8, 2, dtype=torch.bfloat16, batch=1, seq=2048, head_dim=128, device="cuda")
    assert_matches_single_process(case, pools.get(2, "cuda").run(run_cp, case))
