"""The trainer: the same loss curve under every layout, exact resume, TensorBoard, bad configs.

Runs are 10 steps of a tiny Llama on the synthetic recall task, each rank of a
forked gloo pool calling the trainer in-process. Tolerance for comparing layouts:
float32 sums in a different order under each layout (attention blocks, FSDP
reduce-scatter, TP all-reduce), so losses differ in the 7th digit at step 1; AdamW
normalizes each update by the gradient's own scale, which lets those last-bit
differences move parameters by up to ~lr per step where a gradient is tiny. Over 10
steps we measured losses within 1.2e-7 (relative) of cp=1 and allow 1e-5, still far
below the step-to-step change of the loss (~1e-2). Resuming in the same layout is
bit-exact.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpcompose.config import load_config
from cpcompose.train import main as train_main
from cpcompose.training.loop.lr_schedule import lr_factor
from cpcompose.training.loop.trainer import Trainer
from tests.support.cpu_kernels import NEEDS_BF16_CPU_FLASH
from tests.support.trainer import TINY, run_trainer

def losses_for(pools, world: int, args: list[str], device: str = "cpu") -> list[float]:
    results = pools.get(world, device).run(run_trainer, args)
    assert all(r == results[0] for r in results), "every rank reports the same global loss"
    return results[0]


@pytest.fixture(scope="module")
def baseline(pools, tmp_path_factory) -> list[float]:
    return losses_for(pools, 1, [f"--job.dump_folder={tmp_path_factory.mktemp('cp1')}"])


LAYOUTS = {
    "cp2-ring": (2, ["--parallelism.cp=2", "--parallelism.cp_strategy=ring"]),
    "cp2-allgather": (2, ["--parallelism.cp=2", "--parallelism.cp_strategy=allgather"]),
    "cp2-alltoall": (2, ["--parallelism.cp=2", "--parallelism.cp_strategy=alltoall"]),
    "cp4-alltoall_ring-2x2": (4, ["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall_ring",
                                  "--parallelism.cp_alltoall_size=2"]),
    "cp2-contiguous-ac": (2, ["--parallelism.cp=2", "--parallelism.cp_layout=contiguous",
                              "--activation_checkpoint.mode=full"]),
    "dp2-cp2": (4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"]),
    "tp2-cp2": (4, ["--parallelism.cp=2", "--parallelism.tp=2", "--parallelism.dp_shard=1"]),
    # tp without dp x cp (FSDP2 over one rank) under a pipeline; pp x cp under every schedule:
    "pp2-tp2-1f1b": (4, ["--parallelism.tp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
                         "--parallelism.pp_schedule=1F1B"]),
    # every schedule: tests/training/loop/test_trainer_pipeline.py (trainer), test_pipeline_schedules.py
}


def run_trainer_capturing(mesh, args: list[str]) -> tuple[list[float], str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = Trainer(load_config(TINY + args)).run()
    return losses, out.getvalue()


def test_auto_strategy_trains_exactly_and_reports_its_choice(pools, baseline, tmp_path) -> None:
    """`cp_strategy = "auto"`: the cp=1 losses, one log line per call signature, the choice in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["--parallelism.cp=2", "--parallelism.cp_strategy=auto", "--metrics.enable_tensorboard=true",
            f"--job.dump_folder={tmp_path}"]
    results = pools.get(2).run(run_trainer_capturing, args)
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(baseline), rtol=1e-5, atol=0)
    lines = [line for line in results[0][1].splitlines() if "cp strategy auto -> " in line]
    assert len(lines) == 1, results[0][1][-2000:]  # one signature: every layer and step make the same call
    assert not any("cp strategy auto" in r[1] for r in results[1:]), "printed on rank 0 only"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    calls = [t for t in events.Tags()["scalars"] if t.startswith("cp/auto_calls/")]
    assert len(calls) == 1 and calls[0].removeprefix("cp/auto_calls/") in lines[0], (calls, lines)
    assert all(e.value == 2 for e in events.Scalars(calls[0])), "two attention layers a step"  # TINY: 2 layers


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_losses_agree_across_layouts(pools, baseline, tmp_path, name: str) -> None:
    world, args = LAYOUTS[name]
    got = losses_for(pools, world, args + [f"--job.dump_folder={tmp_path}"])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(baseline), rtol=1e-5, atol=0)
    assert baseline[-1] < baseline[0], "the loss falls"


def run_offloaded(mesh, args: list[str]) -> tuple[list[float], list[str]]:
    """Losses, and the offload policy of each FSDP unit of the trained model (none: no FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    trainer = Trainer(load_config(TINY + args))
    losses = trainer.run()
    groups = [m._get_fsdp_state()._fsdp_param_group for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    return losses, sorted({type(g.offload_policy).__name__ for g in groups if g is not None})  # None: no own params


def test_one_rank_offloads_its_parameters_with_fsdp_over_one_rank_and_trains_the_same(pools, baseline,
                                                                                     tmp_path) -> None:
    """`training.offload_params` on one rank over dp x cp: FSDP2 over a one-rank mesh with CPUOffloadPolicy (the
    one-GPU cell), the cp=1 curve bit for bit: one rank's all-gather and reduce-scatter are copies, the same kernels
    run on the same values, and on a CPU device the offload moves nothing."""
    [(got, policies)] = pools.get(1).run(run_offloaded, ["--training.offload_params=true",
                                                         f"--job.dump_folder={tmp_path}"])
    assert policies == ["CPUOffloadPolicy"], policies
    assert got == baseline


CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=5", "--checkpoint.keep_latest_k=3",
        "--metrics.enable_tensorboard=true", "--metrics.plot_loss=true"]


def test_resume_reproduces_and_moves_between_layouts(pools, tmp_path: Path) -> None:
    cp2 = ["--parallelism.cp=2"]
    full = losses_for(pools, 2, cp2 + CKPT + [f"--job.dump_folder={tmp_path / 'run'}"])
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-10", "step-5"]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    _check_tensorboard(tmp_path / "run" / "tb", full)

    def resume_from_step5(world: int, args: list[str], name: str) -> list[float]:
        dump = tmp_path / name
        shutil.copytree(ckpt / "step-5", dump / "checkpoint" / "step-5")
        (dump / "checkpoint" / "step-10.tmp").mkdir()  # a save that crashed: must be ignored
        return losses_for(pools, world, args + CKPT + [f"--job.dump_folder={dump}"])

    assert resume_from_step5(2, cp2, "same") == full[5:]  # bit-exact in the same layout
    for world, args, name in [(1, [], "cp1"), (4, ["--parallelism.cp=4"], "cp4"),
                              (4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"], "dp2cp2")]:
        torch.testing.assert_close(torch.tensor(resume_from_step5(world, args, name)), torch.tensor(full[5:]),
                                   rtol=1e-5, atol=0)


def _check_tensorboard(folder: Path, losses: list[float]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s",
                "train/cp_bytes_sent", "memory/peak_mib_rank0", "memory/peak_mib_rank1"}
    assert expected <= tags, expected - tags
    logged = [e.value for e in events.Scalars("train/loss")]
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(losses, dtype=torch.float32))
    # The rate each step used (TINY: 3e-3, warmup 2 of 10 steps, cosine): step 1 warms up from 1/3 of it.
    rates = [e.value for e in events.Scalars("train/lr")]
    used = [3e-3 * lr_factor(s, name="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1) for s in range(10)]
    torch.testing.assert_close(torch.tensor(rates), torch.tensor(used, dtype=torch.float32))
    assert all(e.value > 0 for e in events.Scalars("train/cp_bytes_sent"))


def _main(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpcompose.train", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--training.seqlen=64"], {}, "training.seqlen"),
        (["--training.seq_len=abc"], {}, "training.seq_len"),
        (["--parallelism.cp=3", "--training.seq_len=64"], {}, "training.seq_len"),
        (["--parallelism.cp=2", "--parallelism.dp_shard=1"], {"WORLD_SIZE": "4"}, "parallelism.dp_shard"),
        (["--parallelism.cp_strategy=tree"], {}, "parallelism.cp_strategy"),
        (["--config", "no/such/file.toml"], {}, "no/such/file.toml"),
    ],
)
def test_bad_config_is_reported_before_any_process_starts(args, env, message, capsys, monkeypatch) -> None:
    """The launcher's own call (`cpcompose.train.main`, what `python -m cpcompose.train` runs), in this process:
    a config error returns 2 before any rank starts (test_command_line_run starts the interpreter itself)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = train_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err


def test_dry_run_prints_the_8b_plan(capsys, monkeypatch) -> None:
    config = Path(__file__).parents[3] / "train_configs" / "llama3_8b_128k.toml"
    monkeypatch.setenv("WORLD_SIZE", "64")
    code = train_main(["--config", str(config), "--job.dry_run=true"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "8.03" in out and "cp=8" in out and "131,072 tokens" in out


@pytest.mark.parametrize("cp", [1, 2])
def test_command_line_run(tmp_path: Path, cp: int) -> None:
    """`python -m cpcompose.train` starts its own ranks (or its lone one) when not under torchrun."""
    result = _main(TINY + [f"--parallelism.cp={cp}", "--training.steps=3", f"--job.dump_folder={tmp_path}"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step     3/3" in result.stdout


def _text_corpus(folder: Path) -> Path:
    """Documents of very different lengths, one JSON line each."""
    import json

    g = torch.Generator().manual_seed(0)
    words = ["context", "parallel", "ring", "zig", "zag", "token", "rank", "shard", "mask", "pack"]
    path = folder / "corpus.jsonl"
    with path.open("w") as f:
        for _ in range(60):
            n = int(torch.randint(1, 40, (), generator=g))
            text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
            f.write(json.dumps({"text": text}) + "\n")
    return path


PACKED = ["--data.source=text", "--data.pack=true", "--model.vocab_size=260", "--training.seq_len=96"]


@pytest.mark.parametrize("name,world,args", [
    ("cp2-ring", 2, ["--parallelism.cp=2"]),
    ("cp2-alltoall", 2, ["--parallelism.cp=2", "--parallelism.cp_strategy=alltoall"]),
    ("cp2-auto", 2, ["--parallelism.cp=2", "--parallelism.cp_strategy=auto"]),  # a choice per batch's pack
    ("dp2-cp2", 4, ["--parallelism.cp=2", "--parallelism.dp_shard=2"]),
])
def test_packed_text_losses_match_one_rank(pools, tmp_path: Path, name: str, world: int, args: list[str]) -> None:
    """data.pack: documents packed with their boundaries; the curve equals cp=1's on the same packs."""
    corpus = _text_corpus(tmp_path)
    common = PACKED + [f"--data.path={corpus}"]
    one = losses_for(pools, 1, common + [f"--job.dump_folder={tmp_path / 'one'}"])
    got = losses_for(pools, world, common + args + [f"--job.dump_folder={tmp_path / name}"])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=1e-5, atol=0)


@NEEDS_BF16_CPU_FLASH  # its cp = 1 run is torch's own bf16 SDPA
def test_bf16_autocast_follows_the_fp32_curve(pools, baseline, tmp_path: Path) -> None:
    """training.mixed_precision=bfloat16 (one rank: autocast; cp=2: FSDP2's MixedPrecisionPolicy, which gathers
    each unit in bf16; CP merges stay float32): same curve within bf16 noise.

    bf16 keeps 8 bits of mantissa (4e-3 relative per element), but the loss averages
    thousands of token losses computed in float32, so over 10 steps we measured it
    within 3e-5 of the fp32 curve, and cp=2 within 3.5e-5 of cp=1 in bf16. We allow
    1e-3: a wrong merge or a bf16 accumulation would move it by far more.
    """
    bf16 = ["--training.mixed_precision=bfloat16"]
    one = losses_for(pools, 1, bf16 + [f"--job.dump_folder={tmp_path / 'one'}"])
    two = losses_for(pools, 2, bf16 + ["--parallelism.cp=2", f"--job.dump_folder={tmp_path / 'two'}"])
    torch.testing.assert_close(torch.tensor(one), torch.tensor(baseline), rtol=1e-3, atol=0)
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-3, atol=0)
    assert one != baseline  # autocast really ran in bf16


CUDA = ["--training.device=cuda", "--training.steps=3"]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ring", "alltoall"])
def test_cuda_cp2_follows_cp1(pools, tmp_path: Path, strategy: str) -> None:
    """training.device=cuda: 3 steps under cp=2 give the losses of cp=1 on the GPU.

    Same tolerance as on CPU (1e-5 relative): fp32 in another summation order.
    """
    one = losses_for(pools, 1, CUDA + [f"--job.dump_folder={tmp_path / 'one'}"], device="cuda")
    two = losses_for(pools, 2, CUDA + ["--parallelism.cp=2", f"--parallelism.cp_strategy={strategy}",
                                       f"--job.dump_folder={tmp_path / 'two'}"], device="cuda")
    assert len(one) == 3 and all(math.isfinite(x) for x in one)
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=0)
