"""The memory plan: its parts follow the config, and its total matches real runs of the trainer.

The real runs are `python -m cpcompose.train` in a fresh interpreter (one rank in-process, two
through the launcher), with a vocabulary large enough that the peak is mostly the step's own
tensors: the unfused loss, the fused loss with chunks smaller than the shard, the fused loss
with a tiled MLP wide enough to matter, and two ranks with FSDP and checkpointing. Their logged
peak (resident-set high-water mark, max over ranks) must be within 15% of the plan, the
issue's target (measured here: within 6%, see each case).

Allocator. Every run has glibc's defaults, as a user's shell has them and the launcher leaves them: the
plan predicts those. (The launcher used to set a heap that keeps everything, whose fragmentation made one
config's peak vary from 1.37 to 1.89 GiB over five runs, and a parameter-dominated run's grow to 1.8x the plan
over four steps.) Three steps each: under the old heap settings the benchmark's parameter-dominated run
(scripts/benchmarks/bench_host_memory.py) was already about 1.5x its plan at the second step; with glibc's defaults its
peak is flat after the first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.training.memory.budget import run_plan
from cpcompose.training.families import family_of
from cpcompose.training.memory.plan import GiB, attention_bytes, plan_memory

ROOT = Path(__file__).resolve().parents[3]
BIG_VOCAB = [
    "--model.vocab_size=16384", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.ffn_hidden_dim=128", "--training.batch_size=1", "--training.steps=3", "--training.device=cpu",
    "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
]
FUSED = ["--training.fused_loss=true", "--training.loss_chunk_tokens=512"]
# Parameters (4x: fp32 shards, moments, gradients) and FSDP's gathered units outweigh the activations: the peak is
# the backward's end, the embedding's bf16 gradient reduced in float32 (the 0.27 B run, scaled down).
PARAMETERS = ["--model.vocab_size=65536", "--model.dim=512", "--model.n_heads=8", "--model.n_kv_heads=2",
              "--model.ffn_hidden_dim=1024", "--training.mixed_precision=bfloat16"]
SMALL = [
    "--model.vocab_size=4096", "--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
    "--model.ffn_hidden_dim=768", "--training.seq_len=8192", "--training.batch_size=1", "--training.device=cpu",
    "--lr_scheduler.warmup_steps=1", "--training.steps=2", "--training.fused_loss=false",
]


def _plan(args: list[str], world: int, device_type: str = "cpu"):
    return plan_memory(load_config(SMALL + args), world, device_type=device_type)


@pytest.mark.parametrize("cp,seq_len,extra", [
    (1, 4096, ["--training.fused_loss=false"]),  # measured within 1%
    (2, 8192, [*FUSED, "--activation_checkpoint.mode=full"]),  # within 6%
    (2, 512, PARAMETERS),  # parameters dominate: within 2% (the 1,024-token run: 1,324 MiB measured, 1,298 planned)
], ids=["unfused", "cp2-fsdp-checkpointed", "cp2-fsdp-bf16-parameters"])  # fused + tiled: the growth test
def test_the_prediction_is_within_15_percent_of_a_real_run(tmp_path: Path, monkeypatch, cp: int, seq_len: int,
                                                           extra: list[str]) -> None:
    for key in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(key)  # as a user's shell
    args = BIG_VOCAB + [f"--parallelism.cp={cp}", f"--training.seq_len={seq_len}", f"--job.dump_folder={tmp_path}",
                        *extra]
    result = subprocess.run([sys.executable, "-m", "cpcompose.train", *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    measured = max(float(x.replace(",", "")) for x in re.findall(r"peak ([\d,]+) MiB", result.stdout)) * 2**20
    predicted = run_plan(load_config(args), cp).total
    assert abs(predicted - measured) <= 0.15 * measured, (predicted / GiB, measured / GiB)
    assert "memory per rank, predicted peak" in result.stdout  # the banner prints the plan


def _measured_peak(args: list[str]) -> int:
    """The logged peak (bytes, max over ranks) of `python -m cpcompose.train` with `args`, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "cpcompose.train", *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(max(float(x.replace(",", "")) for x in re.findall(r"peak ([\d,]+) MiB", result.stdout)) * 2**20)


# Llama-3 proportions (head_dim 64, one KV head of four, a 3.5x SwiGLU) at dim 256: activations of ~50 KiB a token,
# enough for the per-token growth to show beside the fixed ~1 GiB; a vocabulary large enough (and loss chunks small
# enough) that the optimizer step, whose fixed part grows with it, is the peak at both lengths, as at 128k.
SLOPE_BODY = [
    "--model.vocab_size=65536", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=1",
    "--model.ffn_hidden_dim=896", "--training.batch_size=1", "--training.steps=2", "--training.device=cpu",
    "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1", "--training.fused_loss=true",
    "--training.loss_chunk_tokens=128",
]


def test_the_predicted_growth_with_length_matches_a_real_run(tmp_path: Path, monkeypatch) -> None:
    """Plan and run agree on how the peak GROWS from 1,024 to 4,096 tokens, not only on each peak (the fused loss with a
    tiled MLP; the fused loss alone ran here too until the suite outgrew its time, with the numbers below).

    Each peak alone can be within 15% while the per-token slope is off by half (the fixed ~1 GiB hides it), and a
    wrong slope is what makes the plan's longest trainable L wrong: before the plan counted glibc's heap keeping the
    step's per-token high water through the optimizer step, it predicted 34 KiB a token where runs grew by 65-86.
    Tolerance: the plan's growth between 0.6x and 1.8x the run's. The heap's holes vary from run to run far more
    than a peak does: over ten runs of this test here the measured growth was 100-130 MiB (fused; plan 100.6) and
    42-66 MiB (fused + tiled; plan 65.1), ratios 0.77-1.55, whatever MALLOC_ARENA_MAX. The plan that counted one
    block (35 and 23.5 MiB: ratios 0.27-0.56) fails the lower bound on every one of those runs.
    """
    for key in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(key)  # as a user's shell
    peaks, plans = [], []
    for seq_len in (512, 2048):
        args = SLOPE_BODY + [f"--training.seq_len={seq_len}", f"--job.dump_folder={tmp_path / str(seq_len)}",
                             "--training.tiled_mlp=4"]
        peaks.append(_measured_peak(args))
        plans.append(run_plan(load_config(args), 1).total)
    measured, predicted = peaks[1] - peaks[0], plans[1] - plans[0]
    assert 0.6 * measured <= predicted <= 1.8 * measured, (predicted / 2**20, measured / 2**20)
    assert all(abs(p - m) <= 0.15 * m for p, m in zip(plans, peaks, strict=True)), (plans, peaks)


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
    # on CUDA: on CPU glibc's heap keeps the backward's high water through the optimizer step, which peaks then
    backward = _plan(["--activation_checkpoint.mode=full", "--training.fused_loss=true",
                      "--training.loss_chunk_tokens=512"], 1, "cuda")
    assert backward.phase == "backward" and backward.part("one block in flight") > full.part("activations")


def test_offload_moves_the_checkpoints_to_host_memory_on_cuda_only() -> None:
    args = ["--activation_checkpoint.mode=full", "--activation_checkpoint.offload=true"]
    cuda, cpu = _plan(args, 1, "cuda"), _plan(args, 1, "cpu")
    # 4 blocks' float32 inputs (8 MiB each, one power-of-two piece: no rounding) and the rotary cos and sin, float32,
    # head_dim / 2 = 32 wide (the checkpoint saves every positional tensor argument; the same objects every block,
    # so copied once): 1 MiB each in a 2 MiB piece (the smallest), 1 MiB of rounding each.
    # None stays on the device: the block working holds its input again in its recompute ("one block in flight")
    host = dict(cuda.host_parts)
    assert host["checkpointed block inputs"] == (4 * 256 * 4 + 2 * 32 * 4) * 8192
    assert host["pinned-memory rounding"] == 2 * 2**20 and cuda.host_bytes == 4 * 8 * 2**20 + 2 * 2 * 2**20
    assert cuda.part("activations") == 0
    assert cpu.host_bytes == 0 and cpu.part("activations") == 4 * 256 * 4 * 8192


def test_offload_params_keeps_shards_gradients_and_moments_in_host_memory_on_cuda_only() -> None:
    fsdp = ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--training.batch_size=2"]
    kept, cuda = _plan(fsdp, 4, "cuda"), _plan([*fsdp, "--training.offload_params=true"], 4, "cuda")
    shards = kept.part("parameters")
    assert shards > 0 and cuda.host_bytes == 4 * shards  # fp32 shards, their gradients, two moments
    assert all(cuda.part(p) == 0 for p in ("parameters", "optimizer state", "gradients"))
    assert cuda.part("gathered parameters") > 0 and cuda.total < kept.total
    cpu = _plan([*fsdp, "--training.offload_params=true"], 4, "cpu")
    assert cpu.host_bytes == 0 and cpu.part("parameters") == shards  # the host is the device


def test_offload_params_on_one_rank_is_fsdp_over_that_rank_with_nothing_of_the_state_on_the_device() -> None:
    """One rank over dp x cp with offload_params: FSDP2 over one rank (S = 1), the whole model's fp32 parameters,
    gradients and moments on the host, the units gathered in bf16 under FSDP2's mixed precision (no autocast copy)."""
    bf16 = ["--training.mixed_precision=bfloat16"]
    kept, cuda = _plan(bf16, 1, "cuda"), _plan([*bf16, "--training.offload_params=true"], 1, "cuda")
    assert kept.part("parameters") > 0 and kept.part("bf16 weight copies") > 0  # no FSDP: autocast's copies
    assert cuda.host_bytes == 4 * kept.part("parameters")  # fp32 parameters, their gradients, two moments: S = 1
    assert all(cuda.part(p) == 0 for p in ("parameters", "optimizer state", "gradients", "bf16 weight copies"))
    assert cuda.part("gathered parameters") > 0 and cuda.total < kept.total


def test_the_fused_loss_holds_one_chunk_of_logits() -> None:
    whole, fused = _plan([], 1), _plan(["--training.fused_loss=true", "--training.loss_chunk_tokens=1024"], 1)
    head, V, T = (4 * 2 * 256 + 12) * 8192, 4096, 8192  # the final norm keeps its input and a scale per token
    # float32, unfused: the log-softmax, its gradient and the logits' gradient, 12 bytes per logit
    assert whole.phase == "loss" and whole.part("loss") == head + 12 * V * T
    # fused: one chunk's float32 logits, the log-sum-exp and hidden gradient per token, the weight's gradient
    fused_loss = head + 4 * V * 1024 + (4 + 4 * 256) * T + 4 * V * 256
    # the fused loss's per-token tensors are in glibc's heap, which holds the step's high water (the backward's,
    # the same in both) whatever the loss phase holds there: its slack is that much smaller
    in_heap = (4 + 4 * 256) * T
    assert dict(whole.phase_totals)["loss"] - dict(fused.phase_totals)["loss"] == \
        12 * V * T - (fused_loss - head) + in_heap


def test_a_pipeline_computes_the_unfused_loss_and_keeps_each_microbatchs_logits_until_its_backward() -> None:
    """The pipeline's last stage takes the unfused loss on its logits, fused_loss or not; the trainer's
    `schedule.step(..., return_outputs=False)` keeps a microbatch's float32 logits (4 V bytes a token) from its forward
    to its backward only: 1F1B's last rank one microbatch's at a time, GPipe's every one, none at the step's end."""
    def pp(m: int, schedule: str = "1F1B", *extra: str):  # noqa: ANN202
        return _plan(["--parallelism.pp=2", f"--parallelism.pp_microbatches={m}", f"--training.batch_size={m}",
                      f"--parallelism.pp_schedule={schedule}", *extra], 2, "cuda")
    fused, unfused = pp(2, "1F1B", "--training.fused_loss=true"), pp(2, "1F1B", "--training.fused_loss=false")
    assert fused.total == unfused.total and unfused.pp_rank == 1 and unfused.phase == "backward"
    T, logits = unfused.tokens, 4 * 4096 * unfused.tokens
    recv = 4 * 256 * T  # the last stage's input buffer, one per microbatch
    for m in (2, 3):
        assert pp(m).part("pipeline buffers") == m * recv + logits
        assert pp(m, "GPipe").part("pipeline buffers") == m * recv + m * logits
    # one more microbatch at the step's end: its input buffer alone (with CUDA's 10% slack), no logits
    assert dict(pp(3).phase_totals)["gradient reduction"] - dict(pp(2).phase_totals)["gradient reduction"] == \
        pytest.approx(1.1 * recv, abs=2)


def test_bf16_under_fsdp_gathers_units_in_bf16_and_copies_nothing() -> None:
    """FSDP2's MixedPrecisionPolicy: units gathered in bf16 (half the fp32 bytes), no autocast copies."""
    args = [*PARAMETERS, "--parallelism.cp=2", "--training.seq_len=512", "--training.fused_loss=true"]
    fp32, bf16 = _plan([*args, "--training.mixed_precision=float32"], 2), _plan(args, 2)
    assert bf16.part("bf16 weight copies") == 0 and fp32.phase == bf16.phase == "embedding backward"
    embedding = 65536 * 512 + 512  # with the final norm
    assert 2 * bf16.part("gathered parameters") == fp32.part("gathered parameters") == 4 * embedding
    # the embedding's gradient in flight: made in bf16, cast to float32, copied into the reduce-scatter's input
    assert bf16.part("gathered gradients") == (2 + 4 + 4) * embedding


def test_bf16_autocast_keeps_a_copy_of_every_linear_weight() -> None:
    """One rank (no FSDP): bf16 is autocast, whose cache keeps a copy of each linear weight."""
    plan = _plan(["--training.mixed_precision=bfloat16"], 1)
    linear = 4 * (256 * 256 * 2 + 2 * 256 * 128 + 3 * 256 * 768) + 4096 * 256
    assert plan.part("bf16 weight copies") == 2 * linear


def test_attention_buffers_come_from_the_cost_model() -> None:
    """CP's received K/V and dK/dV buffers: the cost model's count, beside the attention's backward only."""
    args = ["--parallelism.cp=4", "--training.fused_loss=true", "--training.loss_chunk_tokens=256",
            "--activation_checkpoint.mode=full"]

    def buffers(extra: list[str], cp: int = 4) -> int:
        config = load_config(SMALL + args[1:] + [f"--parallelism.cp={cp}", *extra])
        profile = family_of(config).memory_profile(config, tp=1, precision="float32", mlp_tiles=1)
        return attention_bytes(config, profile, rows=1, row_len=8192, device_type="cpu")

    ring, gather = buffers([]), buffers(["--parallelism.cp_strategy=allgather"])
    assert 0 < ring < gather
    assert buffers([], cp=1) == 0  # no CP
    assert buffers(["--parallelism.cp_strategy=auto"]) >= gather  # any candidate
    for plan, expected in ((_plan(args, 4), ring), (_plan(args + ["--parallelism.cp_strategy=allgather"], 4), gather)):
        assert plan.part("attention K/V in flight") in (0, expected)  # 0: the feed-forward's backward is larger
        forward = dict(plan.phase_totals)["forward"]
        assert forward >= expected  # the forward's attention holds them too


def test_a_1f1b_pipeline_holds_up_to_pp_microbatches_on_its_first_stage() -> None:
    pp = _plan(["--parallelism.pp=2", "--parallelism.pp_microbatches=4", "--training.batch_size=4",
                "--activation_checkpoint.mode=full"], 2)
    one = _plan(["--activation_checkpoint.mode=full"], 1)
    assert pp.tokens == one.tokens  # batch 4 in 4 microbatches
    assert pp.total == sum(b for _, b in pp.parts) and pp.phase in dict(pp.phase_totals)


def _moe_plans(tmp_path: Path, ep: int) -> tuple:
    """A tiny Qwen3-MoE (8 experts of 3 x 64 x 32, top-2) on 4 ranks (dp_shard = 4) at `ep`, on CUDA (no heap)."""
    import transformers as hf

    folder = tmp_path / "qwen3_moe"
    if not folder.exists():
        hf.Qwen3MoeConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, tie_word_embeddings=False).save_pretrained(folder)
    config = load_config(["--model.name=hf", f"--model.path={folder}", "--parallelism.dp_shard=4",
                          f"--parallelism.ep={ep}", "--training.seq_len=1024", "--training.batch_size=4",
                          "--training.mixed_precision=bfloat16"])
    return plan_memory(config, 4, device_type="cuda"), family_of(config).memory_profile(
        config, tp=1, precision="bfloat16-params", mlp_tiles=1)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallelism_gathers_a_ranks_experts_and_keeps_each_shard(tmp_path: Path, ep: int) -> None:
    one, prof = _moe_plans(tmp_path, 1)
    split, _ = _moe_plans(tmp_path, ep)
    experts = 8 * 3 * 64 * 32
    assert prof.block_expert_params == experts and prof.body_expert_params == 2 * experts
    # every expert's shard is on one of ep x efsdp = dp_shard x cp ranks: the same bytes per rank as without EP
    assert split.part("parameters") == one.part("parameters")
    assert split.part("optimizer state") == one.part("optimizer state")
    # a block's end holds two gathered blocks (bf16) and one block's gradient reduced (bf16, float32, the
    # reduce-scatter's input): each with E/ep experts instead of E
    end_one, end_split = dict(one.phase_totals)["block end"], dict(split.phase_totals)["block end"]
    assert end_one - end_split == (2 * 2 + 10) * (experts - experts // ep)
    # forward: the two gathered blocks shrink the same way, the dispatch's rows in transit are added (top-2 rows of
    # 64 bf16 numbers out and in per token, 10% of them as CUDA's allocator slack)
    dispatch = 2 * 2 * 2 * 64 * split.tokens
    forward_one, forward_split = dict(one.phase_totals)["forward"], dict(split.phase_totals)["forward"]
    assert forward_split - forward_one == pytest.approx(int(1.1 * dispatch) - 2 * 2 * (experts - experts // ep),
                                                        abs=2)
