"""The trainer on Hugging Face mixture-of-experts folders with expert parallelism (`parallelism.ep`, issue 38).

Five tiny float32 MoE families written by transformers' `save_pretrained` (`tests.support.hf_trainer.make_moe`: 4
experts, 2 per token, the routers randomised): Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA, group-limited sigmoid routing
with a nonzero correction bias, a shared expert, one dense and one MoE layer), gpt-oss (transposed biased clamped
experts, a biased router, attention sinks, a sliding layer) and Qwen3-Next (a Gated DeltaNet layer, a shared
expert behind its gate). Each trains 3 steps on packed text at cp = 2 x ep = 2 on 2 ranks (each rank reads its 2
experts of each layer from the folder; the routed rows travel to their expert's rank and back; the dense weights
FSDP-sharded over both ranks, the experts over the expert mesh's efsdp axis, size 1) and at cp = 1 on one process
(the whole model, no EP). The router loss is on (`output_router_logits = true`, `router_aux_loss_coef = 0.1`, a
hundred times transformers' default, so the term is a few percent of the loss and moves the routers), except for
DeepSeek-V3, whose transformers computes none (`output_router_logits = true` is refused for it by name:
tests/training/families/hf/test_preflight.py).

Checked per step: train/loss (the total), train/router_loss and the gradient norm agree between the two runs, and
TensorBoard holds both losses as the trainer returned them. Measured: losses at most 9e-8 relative apart, router
losses 5e-7 (gpt-oss), norms 1e-7 at step 1 and up to 6e-6 later (gpt-oss: AdamW's first update moves its tiny
sink and bias gradients' weights by a full lr whatever their last bits). Step 1's norm (above 1, so max_norm = 1
clips) must agree to relative 1e-5: AdamW's update barely sees a uniform clip, so the losses alone would not catch an
EP rank leaving out the other rank's experts' squares, which moves the norm by 2e-4 relative (Qwen3-MoE, measured).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.train import main
from cpcompose.training.families.hf.memory import profiled_families
from cpcompose.training.loop.trainer import Trainer
from tests.support.hf_trainer import MOE_FAMILIES, hf_args, make_moe, text_corpus

RTOL = 1e-4
"""Float32 summation order only (attention merged through its LSE, the experts' rows, the token sums: ~1e-7 at step
1), carried by AdamW's lr x a gradient's relative error through 3 steps; a flipped top-2 choice moves far more."""
NORM_RTOL = 1e-5
"""Step 1's gradient norm: summation order only (measured 1e-7); the later ones are held to RTOL."""
COEF = 0.1
STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {family: make_moe(root / family, family, **({} if family == "deepseek_v3" else
                                                       {"router_aux_loss_coef": COEF}))
            for family in MOE_FAMILIES}


def run_recording(mesh, args: list[str]) -> dict:  # noqa: ANN001
    """The trainer's run on every rank: per step its loss, router loss and gradient norm; the experts modules'
    classes and parameter count; rank 0's TensorBoard scalars."""
    trainer = Trainer(load_config(args))
    router, norms, step = [], [], trainer.train_step

    def recorded() -> float:
        loss = step()
        router.append(trainer.router_loss)
        norms.append(trainer.grad_norm)
        return loss

    trainer.train_step = recorded  # type: ignore[method-assign]
    losses = trainer.run()
    experts = {name: m for name, m in trainer.model.named_modules() if name.endswith("mlp.experts")}
    logged = {}
    if mesh.get_rank() == 0:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(Path(trainer.config.job.dump_folder) / trainer.config.metrics.save_tb_folder))
        events.Reload()
        logged = {name: [e.value for e in events.Scalars(name)] for name in events.Tags()["scalars"]
                  if name in ("train/loss", "train/router_loss")}
    return {"losses": losses, "router": router, "norms": norms, "kinds": {type(m).__name__ for m in experts.values()},
            "expert_parameters": sum(len(list(m.parameters())) for m in experts.values()),
            "split": len(trainer.trained.expert_parameters), "logged": logged}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_cp2_ep2_matches_one_process(pools, folders, family, tmp_path) -> None:
    """rel 1e-4: the runs differ only in float32 summation order (~1e-7), which AdamW's lr-sized steps carry."""
    corpus, tb = text_corpus(tmp_path), "--metrics.enable_tensorboard=true"
    [one] = pools.get(1).run(run_recording, hf_args(folders[family], corpus, tmp_path / "one", tb, steps=STEPS))
    two = pools.get(2).run(run_recording, hf_args(folders[family], corpus, tmp_path / "two", tb, "--parallelism.cp=2",
                                                  "--parallelism.ep=2", steps=STEPS))
    assert "FSDPExpertParallelExperts" not in one["kinds"] and one["split"] == 0 and one["expert_parameters"] > 0
    routed = family != "deepseek_v3"
    for got in two:
        assert got["kinds"] == {"FSDPExpertParallelExperts"} and got["split"] == one["expert_parameters"], got
        assert got["losses"] == two[0]["losses"] and got["router"] == two[0]["router"] and len(got["losses"]) == STEPS
        for step in range(STEPS):
            assert got["losses"][step] == pytest.approx(one["losses"][step], rel=RTOL), (step, got, one)
            assert got["norms"][step] == pytest.approx(one["norms"][step], rel=RTOL if step else NORM_RTOL), \
                (step, got, one)
            if routed:
                assert got["router"][step] == pytest.approx(one["router"][step], rel=RTOL), (step, got, one)
    for run in (one, two[0]):  # what TensorBoard holds: the total, and the router loss beside it
        assert run["logged"]["train/loss"] == pytest.approx(run["losses"], rel=1e-6)
        if routed:
            assert run["logged"]["train/router_loss"] == pytest.approx(run["router"], rel=1e-6)
        else:
            assert "train/router_loss" not in run["logged"] and run["router"] == [None] * STEPS
    if routed:
        assert 0.01 < COEF * one["router"][0] / one["losses"][0] < 0.1, "the router term matters"
    assert min(one["norms"]) > 1.0, "max_norm = 1 clips: the norm's EP sum matters"


def test_the_plan_and_the_dry_run_name_ep(folders, tmp_path, capsys, monkeypatch) -> None:
    """The dry run (the launch banner's lines) accepts every family's folder at ep = 2 and names ep in its mesh line;
    the memory plan predicts the families it has a profile of and says it does not for the others."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    corpus = text_corpus(tmp_path)
    for family, folder in folders.items():
        code = main([*hf_args(folder, corpus, tmp_path / "dry", "--parallelism.cp=2", "--parallelism.ep=2"),
                     "--job.dry_run"])
        out = capsys.readouterr().out
        assert code == 0, (family, out)
        assert "  mesh: pp=1 dp_replicate=1 dp_shard=1 cp=2 tp=1 ep=2 (experts: efsdp=1 x ep=2" in out, (family, out)
        assert (("memory per rank, predicted peak" in out and "fits the budget" in out) if family in
                profiled_families() else f"no memory profile for Hugging Face model_type '{family}'" in out), out
