"""The trainer's memory options (issue 21): fused loss, tiled MLP, offloaded checkpoints, against plain runs.

Each run is the tiny trainer (tests/support/trainer.py), 4 steps. The reference is the same config with the
option off, on one rank with the unfused loss. Tolerances, and why:

* fused loss, tiled MLP: 1e-5 relative, loss by loss, as tests/training/loop/test_trainer.py allows across layouts
  (float32 sums in another order: per loss chunk, per MLP tile; AdamW lets last-bit differences move a
  parameter by ~lr where its gradient is tiny). Measured <= 1.2e-7 (the fused loss at cp=1 with one chunk is
  bit-identical). The float64-exact checks of the same paths are in tests/distributed/test_composition.py
  (1e-12) and next to each function.
* bf16 autocast (fused loss and tiled MLP on, against the same bf16 run with both off): 1e-4 relative; the
  matmuls are the same bf16 ones, the sums in float32 in another order. Measured 7e-6.
* offload on the CPU: identical losses (tolerance 0): there it is a no-op by design.
* offload on CUDA (gpu): 1e-5 relative: the copy out and back is exact, but the GPU attention backward
  sums with atomics, so two runs of the same step may differ in the last bits either way.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer import run_trainer

STEPS = ["--training.steps=4"]
UNFUSED = ["--training.fused_loss=false"]


def _losses(pools, world: int, args: list[str], tmp_path, name: str, device: str = "cpu") -> list[float]:
    results = pools.get(world, device).run(
        run_trainer, STEPS + args + [f"--job.dump_folder={tmp_path / name}", f"--training.device={device}"])
    assert all(r == results[0] for r in results), "every rank reports the same global loss"
    assert len(results[0]) == 4
    return results[0]


@pytest.fixture(scope="module")
def unfused_cp1(pools, tmp_path_factory) -> list[float]:
    return _losses(pools, 1, UNFUSED, tmp_path_factory.mktemp("cp1"), "unfused")


@pytest.mark.parametrize("world, args", [
    pytest.param(2, ["--parallelism.cp=2", "--training.loss_chunk_tokens=24"], id="cp2-fused-ragged-chunks"),
    pytest.param(4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"], id="dp2-cp2-fused-fsdp"),
    pytest.param(2, ["--parallelism.cp=2", "--training.tiled_mlp=3", "--activation_checkpoint.mode=full"],
                 id="cp2-fused-tiled3-ac"),
    pytest.param(2, ["--parallelism.cp=2", "--training.tiled_mlp=2", "--training.mixed_precision=bfloat16"],
                 id="cp2-fused-tiled2-bf16"),
])
def test_memory_options_follow_the_plain_run(pools, unfused_cp1, tmp_path, world: int, args: list[str]) -> None:
    got = _losses(pools, world, args, tmp_path, "run")
    if "--training.mixed_precision=bfloat16" in args:  # against the same bf16 run without the options
        plain = _losses(pools, world, ["--parallelism.cp=2", "--training.mixed_precision=bfloat16"] + UNFUSED,
                        tmp_path, "plain")
        torch.testing.assert_close(torch.tensor(got), torch.tensor(plain), rtol=1e-4, atol=0)
    else:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(unfused_cp1), rtol=1e-5, atol=0)


def test_offload_on_the_cpu_is_a_no_op(pools, tmp_path) -> None:
    ac = ["--parallelism.cp=2", "--activation_checkpoint.mode=full"]
    assert _losses(pools, 2, ac + ["--activation_checkpoint.offload=true"], tmp_path, "offload") == \
        _losses(pools, 2, ac, tmp_path, "resident")


@pytest.mark.gpu
def test_cuda_offload_follows_the_resident_run(pools, tmp_path) -> None:
    ac = ["--activation_checkpoint.mode=full"]
    offload = _losses(pools, 1, ac + ["--activation_checkpoint.offload=true"], tmp_path, "offload", device="cuda")
    resident = _losses(pools, 1, ac, tmp_path, "resident", device="cuda")
    torch.testing.assert_close(torch.tensor(offload), torch.tensor(resident), rtol=1e-5, atol=0)
