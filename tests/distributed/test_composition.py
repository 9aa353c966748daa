"""CP composed with FSDP2, HSDP, TP, pipelining and activation checkpointing, against one process.

Recipe, per case: every rank builds the same tiny Llama (same seed), applies
`parallelize_llama` for the case's degrees, takes its data (dp ranks get
different batch rows, cp ranks split their rows' sequence, zigzag), runs one
training step with `cp_cross_entropy`, and returns the loss (summed over
dp x cp), every parameter gradient and, after one AdamW step, every parameter,
all gathered to full tensors. The test compares each rank's result with one
process running the same model on the whole batch and sequence.

Tolerance, and why:

* float64 cases: ``|parallel - single| / max|single| <= F64_TOL`` (derived:
  tests/support/tolerance.py, ~3.6e-12) on the loss, every gradient and every
  parameter after the step, each relative to its tensor's largest entry.
  The parallel run does the same arithmetic in another order (LSE merges of
  attention blocks, reduce-scatter / all-reduce sums, TP's partial matmuls), so
  it may differ by a few float64 ulps; any real bug (a missing cp gradient
  reduction, a mean instead of a sum, a wrong mask or position) is off by 1e-6
  relative or much more. Measured over all cases: loss 0 (bit-identical),
  gradients <= 5e-17 absolute and <= 1.1e-15 relative (~5 ulps), parameters
  <= 6.5e-15: AdamW divides by ``|g| + eps``, which scales gradient rounding on
  near-zero entries by up to ``lr / eps = 1e6``, so parameters keep ~150x margin
  and gradients >= 2e4x. The model computes RMSNorm and RoPE in float32
  internally; those roundings are the same on both sides because their inputs
  agree to float64 precision.
* float32 (one case): the reference is the single process in float64; per
  tensor the parallel fp32 max error must be within 4x the single-process fp32
  max error, plus a floor of 64 float32 ulps of the tensor's scale for tensors
  the single-process run happens to get almost exactly. Gradients only: one
  AdamW step divides by sqrt(v) ~ |g|, which turns rounding noise on tiny
  gradients into O(lr) parameter noise, so parameters after the step are
  checked in float64 only. Measured: worst ratio to the single-process fp32
  error 1.26. This case also runs FSDP's fp32 reduce-scatter, which needs
  ``set_force_sum_reduction_for_comms`` on gloo (PREMUL_SUM is missing there).

On CUDA (marked `gpu`): the float32 rule above, on the GPU (cp=2 with FSDP under
each strategy, dp_shard=2 x cp=2 with activation checkpointing), against the same
CPU references. float64 has no fused CUDA attention kernel, so CUDA runs float32;
fp32 matmuls on CUDA do not use TF32 (PyTorch's default), so one GPU process errs
like one CPU process, and 4x plus the 64-ulp floor covers the difference in kernels.

Negative control: the same cp=2 step without the gradient sum over cp is off
by > 1e-3 and is shown to fail the check.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from cpcompose import allreduce_gradients, cp_cross_entropy, cp_linear_cross_entropy
from cpcompose.distributed import build_pipeline_stage, flat_mesh
from cpcompose.parallel import ContextParallel
from cpcompose.models import parallelize_llama, split_llama_for_pipeline
from tests.support.composition import (
    F64_TOL,
    IGNORE,
    build_model,
    gathered,
    global_batch,
    global_loss,
    local_batch,
    make_optimizer,
    parallel_dims,
    root_mesh,
)

# Absolute, plus gradients relative to each tensor's largest entry (wq/wk grads are only ~1e-4).
F64_LIMITS = {"loss rel": F64_TOL, "grads rel": F64_TOL, "params rel": F64_TOL}


@functools.cache
def reference(dtype: torch.dtype) -> dict[str, Any]:
    """One process, whole batch and sequence: loss, gradients, parameters after one AdamW step."""
    model = build_model(dtype)
    tokens, labels = global_batch()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    make_optimizer(model).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"loss": loss.detach().to(torch.float64), "grads": grads, "params": params}


# ---------------------------------------------------------------- the worker


def train_step(_mesh: DeviceMesh, case: dict[str, Any]) -> dict[str, Any]:
    """One step of the case on this rank; returns the global loss and full grads / params."""
    degrees = {k: case[k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if k in case}
    dims = parallel_dims(torch.distributed.get_world_size(), **degrees)
    device = case.get("device", "cpu")
    mesh = root_mesh(dims, device)
    fsdp = case.get("fsdp", True)
    model = build_model(case.get("dtype", torch.float64)).to(device)
    if dims.pp_enabled:
        split_llama_for_pipeline(model, num_stages=dims.pp, stage_index=mesh["pp"].get_local_rank())
    parallelize_llama(
        model, parallel_dims=dims, mesh=mesh, activation_checkpoint=case.get("ac", False), fsdp=fsdp,
        offload_activations=case.get("offload", False), mlp_tiles=case.get("mlp_tiles", 1),
        block_tiles=case.get("block_tiles", 1),
        cp=ContextParallel(strategy=case.get("strategy", "ring"), alltoall_size=case.get("alltoall_size"), seq_dim=1)
        if dims.cp_enabled else None,
    )
    for block in model.layers.values():  # the options reached the blocks (offload: a no-op on the CPU)
        tiled_ffn = case.get("mlp_tiles", 1) > 1 and case.get("block_tiles", 1) == 1  # block tiles cover the FFN
        assert type(block.feed_forward).__name__.startswith("Tiled") == tiled_ffn
        assert block.tiles == block.attention.tiles == case.get("block_tiles", 1)
        assert "OffloadedCheckpointed" in type(block).__name__ or not case.get("offload", False)
    optimizer = make_optimizer(model)
    loss_mesh = flat_mesh(mesh, "dp_cp")
    calls = []  # attention forwards: activation checkpointing must run each one twice
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(lambda *_: calls.append(1))
    tokens, labels, positions = local_batch(mesh, dims, device=device)

    if dims.pp_enabled:
        _, all_labels = global_batch()
        num_tokens = (all_labels != IGNORE).sum()  # the whole batch's count, known before the step

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return cp_cross_entropy(logits, target, mesh=loss_mesh, ignore_index=IGNORE, num_tokens=num_tokens)

        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case["schedule"]]
        stage = build_pipeline_stage(model, parallel_dims=dims, mesh=mesh)
        schedule = schedule_cls(stage, n_microbatches=2, loss_fn=loss_fn, scale_grads=False)
        losses: list[torch.Tensor] = []
        args = (tokens,) if stage.is_first else ()
        schedule.step(*args, position_ids=positions, target=labels if stage.is_last else None, losses=losses)
        loss = torch.stack(losses).sum() if stage.is_last else None
    elif case.get("fused", False):  # the head in the model's forward, logits never whole (5 tokens a chunk)
        loss = model(tokens, positions, head=lambda h, w: cp_linear_cross_entropy(
            h, w, labels, mesh=loss_mesh, ignore_index=IGNORE, chunk_tokens=5))
        loss.backward()
    else:
        loss = cp_cross_entropy(model(tokens, positions), labels, mesh=loss_mesh, ignore_index=IGNORE)
        loss.backward()

    # Each microbatch's attention runs once, twice with activation checkpointing. A pipeline's
    # first step also runs extra forwards to infer shapes, hence >= there.
    expected = len(model.layers) * (2 if dims.pp_enabled else 1) * (2 if case.get("ac", False) else 1)
    ok = len(calls) >= expected if dims.pp_enabled else len(calls) == expected
    assert ok, f"{len(calls)} attention forwards, expected {expected}"
    if not fsdp and dims.dp_cp_size > 1 and not case.get("skip_reduce", False):  # nothing else sums them
        allreduce_gradients(model, loss_mesh)
    if loss is not None:
        loss = global_loss(loss, mesh)
    grads = gathered(model, "grads")
    optimizer.step()
    return {"loss": loss, "grads": grads, "params": gathered(model, "params")}


# ---------------------------------------------------------------- checks


def float64_errors(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Worst error against the float64 reference, over ranks, of the loss, grads and params: absolute, and
    relative to each tensor's largest entry ("... rel")."""
    ref = reference(torch.float64)
    worst = {"loss": 0.0, "loss rel": 0.0, "grads": 0.0, "grads rel": 0.0, "params": 0.0, "params rel": 0.0}
    seen: set[str] = set()
    assert any(got["loss"] is not None for got in per_rank), "no rank returned a loss"
    for rank, got in enumerate(per_rank):
        if got["loss"] is not None:
            worst["loss"] = max(worst["loss"], abs(got["loss"].item() - ref["loss"].item()))
            worst["loss rel"] = max(worst["loss rel"], worst["loss"] / abs(ref["loss"].item()))
        for kind in ("grads", "params"):
            for name, value in got[kind].items():
                truth = ref[kind][name]
                assert value.dtype == torch.float64 and value.shape == truth.shape, f"rank {rank} {name}"
                err = (value - truth).abs().max().item()
                worst[kind] = max(worst[kind], err)
                worst[f"{kind} rel"] = max(worst[f"{kind} rel"], err / truth.abs().max().item())
        seen |= set(got["grads"])
    assert seen == set(ref["grads"]), f"parameters missing from every rank: {set(ref['grads']) - seen}"
    return worst


def check_float64(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    worst = float64_errors(per_rank)
    print(" ".join(f"{kind} {err:.2g}" for kind, err in worst.items()), end=" ")
    for kind, limit in F64_LIMITS.items():
        assert worst[kind] <= limit, f"{kind}: worst error {worst[kind]:.3g} > {limit}"
    return worst


CASES = [
    pytest.param(2, {"cp": 2, "strategy": s}, id=f"cp2-{s}") for s in ("ring", "allgather", "alltoall")
] + [
    pytest.param(2, {"cp": 2, "strategy": "ring", "fsdp": False, "ac": True}, id="cp2-ring-nofsdp-ac"),
] + [
    pytest.param(4, {"cp": 4, "strategy": s}, id=f"cp4-{s}") for s in ("ring", "allgather", "alltoall")
] + [
    pytest.param(4, {"cp": 4, "strategy": "alltoall_ring", "alltoall_size": 2, "ac": True}, id="cp4-alltoall_ring-2x2-ac"),
] + [
    pytest.param(4, {"dp_shard": 2, "cp": 2, "strategy": "ring", "ac": True}, id="fsdp2xcp2-ring-ac"),
    pytest.param(4, {"dp_shard": 2, "cp": 2, "strategy": "alltoall"}, id="fsdp2xcp2-alltoall"),
    pytest.param(4, {"dp_replicate": 2, "cp": 2, "strategy": "allgather"}, id="hsdp2xcp2-allgather"),
    pytest.param(2, {"dp_replicate": 2}, id="hsdp2-shard1-nocp"),  # replicate only: HSDP with 1-rank shards
    pytest.param(4, {"tp": 2, "cp": 2, "strategy": "ring"}, id="tp2xcp2-ring"),
    pytest.param(4, {"tp": 2, "cp": 2, "strategy": "alltoall", "fsdp": False}, id="tp2xcp2-alltoall-nofsdp"),
    # GPipe and every other schedule, with FSDP2 over cp: tests/distributed/test_pipeline_schedules.py
    pytest.param(
        4, {"pp": 2, "cp": 2, "strategy": "allgather", "schedule": "1f1b", "fsdp": False, "ac": True},
        id="pp2xcp2-1f1b-allgather-nofsdp-ac",
    ),
    pytest.param(4, {"pp": 2, "cp": 2, "strategy": "alltoall", "schedule": "1f1b"}, id="pp2xcp2-1f1b-alltoall"),
] + [  # the memory options (issue 21): fused loss, tiled MLP, offloaded checkpoints (a no-op on the CPU)
    pytest.param(2, {"cp": 2, "strategy": "ring", "ac": True, "offload": True, "mlp_tiles": 3, "fused": True},
                 id="cp2-ring-ac-offload-tiled3-fused"),
    # the whole block tiled (issue 40): with FSDP2 over dp_shard x cp, checkpointing and the fused loss
    pytest.param(4, {"dp_shard": 2, "cp": 2, "strategy": "ring", "ac": True, "block_tiles": 4, "fused": True},
                 id="fsdp2xcp2-ring-ac-blocktiles4-fused"),
    pytest.param(4, {"tp": 2, "cp": 2, "strategy": "ring", "mlp_tiles": 2, "fused": True},
                 id="tp2xcp2-ring-tiled2-fused"),
]


@pytest.mark.parametrize(("world", "case"), CASES)
def test_matches_single_process_float64(pools, world: int, case: dict[str, Any]) -> None:
    check_float64(pools.get(world).run(train_step, case))


def test_unreduced_gradients_are_caught(pools) -> None:
    """Negative control: skipping the cp gradient sum (fsdp=False, no allreduce) fails the check by far."""
    worst = float64_errors(pools.get(2).run(train_step, {"cp": 2, "fsdp": False, "skip_reduce": True}))
    assert worst["loss rel"] <= F64_TOL  # the loss is reduced by the test itself
    assert worst["grads rel"] > 1e-3 and worst["params rel"] > 1e-3


def check_float32(per_rank: list[dict[str, Any]]) -> None:
    """The loss and every gradient within 4x one float32 process's error, plus 64 ulps (module docstring)."""
    exact, single = reference(torch.float64), reference(torch.float32)
    ulp, ratio = torch.finfo(torch.float32).eps, 0.0
    for rank, got in enumerate(per_rank):
        pairs = [("loss", got["loss"], single["loss"], exact["loss"])]
        pairs += [(name, got["grads"][name], single["grads"][name], exact["grads"][name]) for name in exact["grads"]]
        for name, value, base, truth in pairs:
            err = (value.double() - truth).abs().max().item()
            base_err = (base.double() - truth).abs().max().item()
            bound = 4 * base_err + 64 * ulp * truth.abs().max().item()
            assert err <= bound, f"rank {rank} {name}: fp32 error {err:.3g} > {bound:.3g} (one process: {base_err:.3g})"
            ratio = max(ratio, err / max(base_err, 1e-30))
    print(f"worst fp32 error / single-process fp32 error: {ratio:.2f}", end=" ")


def test_fp32_dp_shard_cp_within_single_process_error(pools) -> None:
    """dp_shard=2 x cp=2 in float32: as accurate as one float32 process (see the module docstring)."""
    check_float32(pools.get(4).run(train_step, {"dp_shard": 2, "cp": 2, "dtype": torch.float32}))


CUDA_CASES = [
    pytest.param(2, {"cp": 2, "strategy": s}, id=f"cp2-fsdp-{s}") for s in ("ring", "allgather", "alltoall")
] + [pytest.param(4, {"dp_shard": 2, "cp": 2, "strategy": "ring", "ac": True}, id="fsdp2xcp2-ring-ac")]


@pytest.mark.gpu
@pytest.mark.parametrize(("world", "case"), CUDA_CASES)
def test_cuda_fp32_within_single_process_error(pools, world: int, case: dict[str, Any]) -> None:
    """The reference Llama's training step on the GPU, FSDP over dp_shard x cp: as accurate as one fp32 process."""
    check_float32(pools.get(world, "cuda").run(train_step, {**case, "dtype": torch.float32, "device": "cuda"}))

