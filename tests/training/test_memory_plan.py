"""The memory plan: its parts follow the config, and its total matches real runs of the trainer.

The real runs are `python -m cpcompose.train` in a fresh interpreter (one rank in-process, two
through the launcher and its allocator settings), with a vocabulary large enough that the peak
is mostly the step's own tensors; their logged peak (resident-set high-water mark, max over
ranks) must be within 15% of the plan, the issue's target (measured here: within 7%).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.training.memory_budget import run_plan
from cpcompose.training.memory_plan import GiB, plan_memory

ROOT = Path(__file__).resolve().parents[2]
BIG_VOCAB = [
    "--model.vocab_size=16384", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.ffn_hidden_dim=128", "--training.batch_size=1", "--training.steps=3", "--training.device=cpu",
    "--lr_scheduler.warmup_steps=1", "--training.fused_loss=false", "--metrics.log_freq=1",
]
SMALL = [
    "--model.vocab_size=4096", "--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.ffn_hidden_dim=768", "--training.seq_len=8192", "--training.batch_size=1", "--training.device=cpu",
    "--lr_scheduler.warmup_steps=1", "--training.steps=2", "--training.fused_loss=false",
]


def _plan(args: list[str], world: int, device_type: str = "cpu"):
    return plan_memory(load_config(SMALL + args), world, device_type=device_type)


@pytest.mark.parametrize("cp,seq_len,extra", [
    (1, 4096, []),
    (2, 8192, ["--activation_checkpoint.mode=full"]),
])
def test_the_prediction_is_within_15_percent_of_a_real_run(tmp_path: Path, monkeypatch, cp: int, seq_len: int,
                                                           extra: list[str]) -> None:
    for key in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(key)  # as a user's shell: the launcher sets its own for two ranks
    args = BIG_VOCAB + [f"--parallelism.cp={cp}", f"--training.seq_len={seq_len}", f"--job.dump_folder={tmp_path}",
                        *extra]
    result = subprocess.run([sys.executable, "-m", "cpcompose.train", *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = max(float(x.replace(",", "")) for x in re.findall(r"peak ([\d,]+) MiB", result.stdout)) * 2**20
    predicted = run_plan(load_config(args), cp).total
    assert abs(predicted - measured) <= 0.15 * measured, (predicted / GiB, measured / GiB)
    assert "memory per rank, predicted peak" in result.stdout  # the banner prints the plan


def test_fsdp_shards_parameters_gradients_and_moments_over_dp_shard_times_cp() -> None:
    one, four = _plan([], 1), _plan(["--parallelism.cp=2", "--parallelism.dp_shard=2", "--training.batch_size=2"], 4)
    assert four.part("parameters") == one.part("parameters") // 4
    assert four.part("optimizer state") == 2 * four.part("parameters")
    assert one.part("gathered parameters") == 0 < four.part("gathered parameters")  # no FSDP on one rank
    assert four.tokens == one.tokens // 2


def test_checkpointing_keeps_block_inputs_and_recomputes_one_block() -> None:
    none, full = _plan([], 1), _plan(["--activation_checkpoint.mode=full"], 1)
    assert full.part("activations") == 4 * 256 * 4 * 8192  # 4 blocks' float32 inputs
    assert full.part("activations") < none.part("activations") / 10
    backward = _plan(["--activation_checkpoint.mode=full", "--training.fused_loss=true",
                      "--training.loss_chunk_tokens=512"], 1)
    assert backward.phase == "backward" and backward.part("one block in flight") > full.part("activations")


def test_offload_moves_the_checkpoints_to_host_memory_on_cuda_only() -> None:
    args = ["--activation_checkpoint.mode=full", "--activation_checkpoint.offload=true"]
    cuda, cpu = _plan(args, 1, "cuda"), _plan(args, 1, "cpu")
    assert cuda.host_bytes == 4 * 256 * 4 * 8192 and cuda.part("activations") == 4 * 256 * 2 * 8192
    assert cpu.host_bytes == 0 and cpu.part("activations") == 4 * 256 * 4 * 8192


def test_the_fused_loss_holds_one_chunk_of_logits() -> None:
    whole, fused = _plan([], 1), _plan(["--training.fused_loss=true", "--training.loss_chunk_tokens=1024"], 1)
    head = (4 * 3 * 256 + 12) * 8192
    assert whole.phase == "loss" and whole.part("loss") == head + 16 * 4096 * 8192  # float32: 16 bytes per logit
    loss_phase = dict(fused.phase_totals)["loss"]
    assert dict(whole.phase_totals)["loss"] - loss_phase >= 16 * 4096 * (8192 - 1024)


def test_bf16_autocast_keeps_a_copy_of_every_linear_weight() -> None:
    plan = _plan(["--training.mixed_precision=bfloat16"], 1)
    linear = 4 * (256 * 256 * 2 + 2 * 256 * 128 + 3 * 256 * 768) + 4096 * 256
    assert plan.part("bf16 weight copies") == 2 * linear


def test_attention_buffers_come_from_the_cost_model() -> None:
    args = ["--parallelism.cp=4", "--training.fused_loss=true", "--training.loss_chunk_tokens=256",
            "--activation_checkpoint.mode=full"]  # the peak in backward, where attention runs
    ring, gather = _plan(args, 4), _plan(args + ["--parallelism.cp_strategy=allgather"], 4)
    assert 0 < ring.part("attention K/V in flight") < gather.part("attention K/V in flight")
    assert _plan(["--training.fused_loss=true"], 1).part("attention K/V in flight") == 0  # no CP
    auto = _plan(args + ["--parallelism.cp_strategy=auto"], 4)
    assert auto.part("attention K/V in flight") >= gather.part("attention K/V in flight")  # any candidate


def test_a_1f1b_pipeline_holds_up_to_pp_microbatches_on_its_first_stage() -> None:
    pp = _plan(["--parallelism.pp=2", "--parallelism.pp_microbatches=4", "--training.batch_size=4",
                "--activation_checkpoint.mode=full"], 2)
    one = _plan(["--activation_checkpoint.mode=full"], 1)
    assert pp.tokens == one.tokens  # batch 4 in 4 microbatches
    assert pp.total == sum(b for _, b in pp.parts) and pp.phase in dict(pp.phase_totals)
